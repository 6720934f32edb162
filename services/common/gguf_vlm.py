"""The HF folder of llama.cpp's file pair: a text GGUF plus its `--mmproj` vision projector.

The text model's config, tokenizer and (de-quantized, float32) weights come from the text
GGUF as services/common/gguf_conversion.py reads any GGUF; the vision encoder and projector
from the mmproj file (services/common/gguf_mmproj.py). Written here: a LlavaConfig or
Idefics3Config joining them, the family's HF processor built from the mmproj's keys (image
size, mean, std, patch size, Idefics3's pixel shuffle and longest edge), the tokenizer, and
one model.safetensors under the names HF's save_pretrained gives the VLM, so every role
reads the pair as it reads an HF VLM folder.
"""

from __future__ import annotations

from pathlib import Path

from services.common.gguf_mmproj import Mmproj, VisionFacts, read_mmproj
from services.common.model_errors import ModelLoadError

IMAGE_TOKEN = "<image>"
# The tokens Idefics3's processor puts around and between an image's tiles; it would add
# any the vocabulary lacks, past the text model's embedding table, so all must be there.
IDEFICS3_TOKENS = ("<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>")
# Where each family keeps the text model's `model.*` parameters.
TEXT_PREFIX = {"mlp": "model.language_model.", "idefics3": "model.text_model."}


def write_vlm_folder(
    text_config, text_tensors: dict, tokenizer, mmproj_path: Path, out_dir: Path
) -> None:
    """Write the pair's VLM folder into `out_dir` from the text GGUF's config, float32
    tensors (HF causal-LM names) and tokenizer, and the mmproj file at `mmproj_path`."""
    mmproj = read_mmproj(mmproj_path)
    facts = mmproj.facts
    if facts.text_hidden_size != text_config.hidden_size:
        raise ModelLoadError(
            f"mmproj file {mmproj_path} projects into width {facts.text_hidden_size}, but the "
            f"text model's hidden size is {text_config.hidden_size}: not a pair"
        )
    needed = (IMAGE_TOKEN,) if facts.projector == "mlp" else IDEFICS3_TOKENS
    image_token_id = _token_ids(tokenizer, needed, text_config.vocab_size)[IMAGE_TOKEN]
    text_config.tie_word_embeddings = False  # lm_head is written out (below)
    build = _llava if facts.projector == "mlp" else _idefics3
    config, processor = build(facts, text_config, tokenizer, image_token_id)
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config.dtype = torch.float32
    weights = _weights(config, facts.projector, text_tensors, mmproj)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(text_config).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _token_ids(tokenizer, tokens: tuple[str, ...], vocab_size: int) -> dict[str, int]:
    """Each token's id in the text GGUF's vocabulary, which must hold it whole."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab or vocab[t] >= vocab_size]
    if missing:
        raise ModelLoadError(
            f"the text GGUF's vocabulary has no {', '.join(missing)} token: the image's "
            "positions in the prompt need it (is the text GGUF this projector's pair? "
            "llama.cpp's LLaVA-1.5 text files have none, llama.cpp splices images in without "
            "one: serve the model's HF folder instead)"
        )
    return {t: vocab[t] for t in tokens}


def _llava(facts: VisionFacts, text_config, tokenizer, image_token_id: int):
    """LLaVA: CLIP whose last kept block's output, class token dropped, is projected."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaProcessor

    vision = CLIPVisionConfig(
        **_vision_sizes(facts), hidden_act="gelu" if facts.use_gelu else "quick_gelu"
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_index=image_token_id,
        vision_feature_layer=-1,  # the file holds the blocks up to LLaVA's feature layer
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    side = facts.image_size
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": side},
        crop_size={"height": side, "width": side},
        image_mean=list(facts.image_mean),
        image_std=list(facts.image_std),
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=facts.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token
        image_token=IMAGE_TOKEN,
        chat_template=tokenizer.chat_template,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config, processor


def _idefics3(facts: VisionFacts, text_config, tokenizer, image_token_id: int):
    """Idefics3 / SmolVLM: SigLIP, pixel shuffle by the scale factor, one linear."""
    from transformers import (
        Idefics3Config,
        Idefics3ImageProcessor,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    vision = Idefics3VisionConfig(
        **_vision_sizes(facts), hidden_act="gelu_pytorch_tanh" if facts.use_gelu else "quick_gelu"
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text_config.to_dict(),
        scale_factor=facts.scale_factor,
        image_token_id=image_token_id,
    )
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": facts.longest_edge},
        max_image_size={"longest_edge": facts.image_size},
        image_mean=list(facts.image_mean),
        image_std=list(facts.image_std),
        do_image_splitting=True,
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        # embeddings per tile: its patches after the pixel shuffle
        image_seq_len=(facts.patches_per_side // facts.scale_factor) ** 2,
        chat_template=tokenizer.chat_template,
    )
    config.architectures = ["Idefics3ForConditionalGeneration"]
    return config, processor


def _vision_sizes(facts: VisionFacts) -> dict:
    return dict(
        hidden_size=facts.hidden_size,
        intermediate_size=facts.intermediate_size,
        num_hidden_layers=facts.num_layers,
        num_attention_heads=facts.num_heads,
        image_size=facts.image_size,
        patch_size=facts.patch_size,
        layer_norm_eps=facts.layer_norm_eps,
    )


def _weights(config, projector: str, text_tensors: dict, mmproj: Mmproj) -> dict:
    """The VLM's parameters under the names its save_pretrained writes: the text model's
    `model.*` under the family's prefix, lm_head (the embedding when the GGUF ties it),
    the mmproj's tensors; HF's own renaming turns the model's names into the file's."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    prefix = TEXT_PREFIX[projector]
    weights = {
        (prefix + name.removeprefix("model.") if name.startswith("model.") else name): tensor
        for name, tensor in text_tensors.items()
    }
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights[prefix + "embed_tokens.weight"].clone()
    weights |= mmproj.tensors
    with torch.device("meta"):  # only for the names: no memory, no init
        skeleton = AutoModelForImageTextToText.from_config(config)
    expected = set(skeleton.state_dict())
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ModelLoadError(
            f"the text GGUF and mmproj file do not make a {type(skeleton).__name__}: missing "
            f"{', '.join(missing[:6]) or 'nothing'}; unexpected {', '.join(extra[:6]) or 'nothing'}"
        )
    saved = revert_weight_conversion(skeleton, weights)
    return {name: tensor.to(torch.float32).contiguous() for name, tensor in saved.items()}
