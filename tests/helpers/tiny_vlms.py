"""Tiny random vision-language models of each supported family, saved as real HF folders
(weights, config, tokenizer and the family's own HF processor), and images to show them.

Every family shares the tiny byte-level tokenizer (tests/helpers/tiny_tokenizer.py) plus
its image tokens, and a chat template that renders OpenAI-style content lists: a
{"type": "image"} part becomes the family's image marker, which the processor expands.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FAMILIES = ("llava", "idefics3")

# Renders string contents and content lists ({"type": "text"} / {"type": "image"} parts).
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}<image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)

TEXT_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
VISION_SIZES = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
)


def random_image(seed: int = 0, size: tuple[int, int] = (50, 40)):
    """A PIL RGB image of random pixels, `size` = (width, height)."""
    from PIL import Image

    width, height = size
    pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def build_tiny_vlm(family: str, folder: Path, seed: int = 0) -> Path:
    """Saves the tiny `family` model with its tokenizer and processor into `folder`."""
    import torch

    from tests.helpers.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    torch.manual_seed(seed)
    model, processor = _BUILDERS[family](tokenizer)
    model.eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _text_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, **TEXT_SIZES)


def _llava(tokenizer):
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(image_size=32, patch_size=8, projection_dim=32, **VISION_SIZES)
    config = LlavaConfig(
        vision_config=vision,
        text_config=_text_config(len(tokenizer) + 16),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token
        chat_template=VLM_CHAT_TEMPLATE,
    )
    return LlavaForConditionalGeneration(config), processor


def _idefics3(tokenizer):
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        Idefics3VisionConfig,
    )

    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<fake_token_around_image>",
                "<image>",
                "<end_of_utterance>",
                "<global-img>",
            ]
        }
    )
    vision = Idefics3VisionConfig(image_size=32, patch_size=8, **VISION_SIZES)
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=_text_config(len(tokenizer) + 16).to_dict(),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=4,  # (32 / 8)^2 patches / scale_factor^2
        chat_template=VLM_CHAT_TEMPLATE,
    )
    return Idefics3ForConditionalGeneration(config), processor


# Gemma 3's image tokens, under the names of its vocabulary (llama.cpp's pair looks them up).
GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def _gemma3(tokenizer):
    """Gemma 3: SigLIP (no head) over 32-pixel squares, its 4 x 4 patches average-pooled
    to 4 soft tokens between <start_of_image> / <end_of_image>; the text model as
    llama.cpp's gemma3 GGUF states it (query_pre_attn_scalar = head_dim, tied)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    tokenizer.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    tokenizer._set_model_specific_special_tokens(special_tokens=GEMMA3_TOKENS)
    tokenizer.chat_template = VLM_CHAT_TEMPLATE.replace("<image>", "<start_of_image>")
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
    head_dim = TEXT_SIZES["hidden_size"] // TEXT_SIZES["num_attention_heads"]
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer) + 16,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=512,
        **TEXT_SIZES,
    )
    vision = SiglipVisionConfig(image_size=32, patch_size=8, vision_use_head=False, **VISION_SIZES)
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
    )
    image_processor = Gemma3ImageProcessor(size={"height": 32, "width": 32})
    processor = Gemma3Processor(
        image_processor, tokenizer, image_seq_length=4, chat_template=tokenizer.chat_template
    )
    return Gemma3ForConditionalGeneration(config), processor


# Qwen2.5-VL's prompt wraps each image's pads in its vision start / end tokens.
QWEN2_5_VL_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace(
    "<image>", "<|vision_start|><|image_pad|><|vision_end|>"
)


def _qwen2_5_vl(tokenizer):
    """Qwen2.5-VL: 8-pixel patches merged 2 x 2, windows of 2 x 2 merged tokens (32
    pixels) in layers 0 and 2, full attention in 1 and 3; M-RoPE's sections split the
    text heads' 8 rotary frequencies 2 / 3 / 3; images resized to 256 .. 9216 pixels."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = QWEN2_5_VL_CHAT_TEMPLATE
    ids = dict(zip(tokens, tokenizer.convert_tokens_to_ids(tokens), strict=True))
    text = dict(
        vocab_size=len(tokenizer) + 16,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        **TEXT_SIZES,
    )
    vision = dict(
        depth=4,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        patch_size=8,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=32,
        fullatt_block_indexes=[1, 3],
        out_hidden_size=TEXT_SIZES["hidden_size"],
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    # Qwen2_5_VLProcessor will not build without torchvision (its video processor needs
    # it): the folder holds the image processor, as the released ones do, and tests
    # expand a prompt's pads themselves (expand_qwen2_5_vl_pads).
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=96 * 96
    )
    return Qwen2_5_VLForConditionalGeneration(config), image_processor


def expand_qwen2_5_vl_pads(ids: list[int], pad_id: int, grids: list[list[int]], merge: int):
    """`ids` with the i-th image pad repeated for image i's merged patches (t * h * w /
    merge^2, its image_grid_thw): what Qwen2_5_VLProcessor does to a prompt's text."""
    out, pending = [], iter(grids)
    for token in ids:
        count = 1
        if token == pad_id:
            t, h, w = next(pending)
            count = t * h * w // merge**2
        out += [token] * count
    return out


_BUILDERS = {
    "llava": _llava,
    "idefics3": _idefics3,
    "gemma3": _gemma3,
    "qwen2_5_vl": _qwen2_5_vl,
}


def build_gemma3_processor_folder(folder):
    """A tiny Gemma 3 folder's config, tokenizer and processor (no weights: the frontend
    reads none). Its processor calls the marker <start_of_image> its image token; the
    config's image token is the soft token the encoder's rows replace."""
    from transformers import (
        Gemma3Config,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from tests.helpers.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    names = {"boi_token": "<start_of_image>", "image_token": "<soft>", "eoi_token": "<end_img>"}
    tokenizer.add_special_tokens({"additional_special_tokens": list(names.values())})
    tokenizer._set_model_specific_special_tokens(special_tokens=names)  # as Gemma's has them
    tokenizer.chat_template = VLM_CHAT_TEMPLATE.replace("<image>", "<start_of_image>")
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in names.items()}
    config = Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(tokenizer) + 16, **TEXT_SIZES),
        vision_config=SiglipVisionConfig(image_size=32, patch_size=8, **VISION_SIZES),
        mm_tokens_per_image=4,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
    )
    image_processor = Gemma3ImageProcessor(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor, tokenizer, image_seq_length=4)
    for part in (config, processor, tokenizer):
        part.save_pretrained(folder)
    return folder
