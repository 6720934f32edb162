"""The HF folder of llama.cpp's file pair: a text GGUF plus its `--mmproj` vision projector.

The text model's config and tokenizer come from the text GGUF as services/common/
gguf_conversion.py reads any GGUF; the vision encoder and projector from the mmproj file
(services/common/gguf_mmproj.py). Written here: a LlavaConfig, Idefics3Config or
Gemma3Config joining them, the family's HF processor built from the mmproj's keys, the
tokenizer, and model.safetensors with the vision and projector weights under the names
HF's save_pretrained gives the VLM. The text model's weights stay in the text GGUF (kept
quantized, as a text .gguf model's are; gguf_conversion's `text_gguf_of` names it to the
worker), but for a text GGUF outside the native families: de-quantized into the folder,
as gguf_conversion writes any such model.
"""

from __future__ import annotations

from pathlib import Path

from services.common.gguf_mmproj import VisionFacts, read_mmproj
from services.common.model_errors import ModelLoadError

IMAGE_TOKEN = "<image>"
# The tokens Idefics3's processor puts around and between an image's tiles; it would add
# any the vocabulary lacks, past the text model's embedding table, so all must be there.
IDEFICS3_TOKENS = ("<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>")
# Gemma 3's: an image is <start_of_image>, its soft tokens (the encoder's rows), <end_of_image>.
GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
NEEDED_TOKENS = {
    "mlp": (IMAGE_TOKEN,),
    "idefics3": IDEFICS3_TOKENS,
    "gemma3": tuple(GEMMA3_TOKENS.values()),
}
# Where each family's HF model keeps the text model's `model.*` parameters (by model_type).
TEXT_PREFIX = {
    "llava": "model.language_model.",
    "idefics3": "model.text_model.",
    "gemma3": "model.language_model.",
}


def write_vlm_folder(
    text_config, text_tensors: dict, tokenizer, mmproj_path: Path, out_dir: Path
) -> None:
    """Write the pair's VLM folder into `out_dir` from the text GGUF's config and tokenizer
    and the mmproj file at `mmproj_path`: the vision and projector weights, and the text
    model's only when `text_tensors` holds them (float32, HF causal-LM names: a text model
    outside the native families; the native ones' stay in their GGUF)."""
    mmproj = read_mmproj(mmproj_path)
    facts = mmproj.facts
    if facts.text_hidden_size != text_config.hidden_size:
        raise ModelLoadError(
            f"mmproj file {mmproj_path} projects into width {facts.text_hidden_size}, but the "
            f"text model's hidden size is {text_config.hidden_size}: not a pair"
        )
    ids = _token_ids(tokenizer, NEEDED_TOKENS[facts.projector], text_config.vocab_size)
    if text_tensors:
        text_config.tie_word_embeddings = False  # lm_head is written out (text_weights)
    build = {"mlp": _llava, "idefics3": _idefics3, "gemma3": _gemma3}[facts.projector]
    config, processor = build(facts, text_config, tokenizer, ids)
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    config.dtype = torch.float32
    weights = _saved_weights(config, mmproj.tensors, text=False)
    if text_tensors:
        weights |= text_weights(config, text_tensors)
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


def _llava(facts: VisionFacts, text_config, tokenizer, ids: dict[str, int]):
    """LLaVA: CLIP whose last kept block's output, class token dropped, is projected."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaProcessor

    vision = CLIPVisionConfig(
        **_vision_sizes(facts), hidden_act="gelu" if facts.use_gelu else "quick_gelu"
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_index=ids[IMAGE_TOKEN],
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


def _idefics3(facts: VisionFacts, text_config, tokenizer, ids: dict[str, int]):
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
        image_token_id=ids[IMAGE_TOKEN],
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


def _gemma3(facts: VisionFacts, text_config, tokenizer, ids: dict[str, int]):
    """Gemma 3: SigLIP (no head) over one square image, its patches average-pooled by the
    scale factor into soft tokens, Gemma's norm and the projection."""
    from transformers import (
        Gemma3Config,
        Gemma3ImageProcessor,
        Gemma3Processor,
        SiglipVisionConfig,
    )

    vision = SiglipVisionConfig(
        **_vision_sizes(facts),
        hidden_act="gelu_pytorch_tanh" if facts.use_gelu else "quick_gelu",
        vision_use_head=False,
    )
    soft_tokens = (facts.patches_per_side // facts.scale_factor) ** 2
    config = Gemma3Config(
        text_config=text_config.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=soft_tokens,
        boi_token_index=ids[GEMMA3_TOKENS["boi_token"]],
        eoi_token_index=ids[GEMMA3_TOKENS["eoi_token"]],
        image_token_index=ids[GEMMA3_TOKENS["image_token"]],
    )
    side = facts.image_size
    image_processor = Gemma3ImageProcessor(
        size={"height": side, "width": side},
        image_mean=list(facts.image_mean),
        image_std=list(facts.image_std),
    )
    # Gemma3Processor reads its tokens from the tokenizer's named special tokens
    tokenizer._set_model_specific_special_tokens(special_tokens=GEMMA3_TOKENS)
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=soft_tokens,
        chat_template=tokenizer.chat_template,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
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


def text_weights(config, text_tensors: dict) -> dict:
    """The text model's tensors (HF causal-LM names) under the names the VLM's
    save_pretrained writes, float32; lm_head the embedding when the GGUF ties it."""
    prefix = TEXT_PREFIX[config.model_type]
    weights = {
        (prefix + name.removeprefix("model.") if name.startswith("model.") else name): tensor
        for name, tensor in text_tensors.items()
    }
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights[prefix + "embed_tokens.weight"].clone()
    return _saved_weights(config, weights, text=True)


def _saved_weights(config, weights: dict, text: bool) -> dict:
    """`weights` (the VLM's parameter names) under the names its save_pretrained writes,
    float32: exactly the model's text parameters (`text`) or its vision and projector
    ones. HF's own renaming turns the model's names into the file's."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):  # only for the names: no memory, no init
        skeleton = AutoModelForImageTextToText.from_config(config)
    text_names = (TEXT_PREFIX[config.model_type], "lm_head.")
    expected = {name for name in skeleton.state_dict() if name.startswith(text_names) == text}
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ModelLoadError(
            f"the text GGUF and mmproj file do not make a {type(skeleton).__name__}: missing "
            f"{', '.join(missing[:6]) or 'nothing'}; unexpected {', '.join(extra[:6]) or 'nothing'}"
        )
    saved = revert_weight_conversion(skeleton, weights)
    return {name: tensor.to(torch.float32).contiguous() for name, tensor in saved.items()}
