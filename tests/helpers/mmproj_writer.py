"""llama.cpp's file pair written from a tiny HF VLM folder (tests/helpers/tiny_vlms.py): the
text model as a llama (Gemma 3: gemma3) GGUF with the folder's own tokenizer, and the vision
encoder plus projector as an mmproj GGUF with llama.cpp's keys and tensor names, laid out as
its converters lay them out (LLaVA: tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py,
the blocks past the feature layer and the post-layernorm dropped, fc1 / fc2 written as
ffn_down / ffn_up; Idefics3: convert_hf_to_gguf.py's SmolVLM, embeddings F32; Gemma 3: its
Gemma3VisionModel, the soft-embedding norm stored as 1 + w, the pooling's scale factor
written only when it is not llama.cpp's default 4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.helpers.tiny_gguf import _add_tensors

PROJECTOR = {"llava": "mlp", "idefics3": "idefics3", "gemma3": "gemma3"}
# Where each family keeps its text model's `model.*` parameters.
TEXT_PREFIX = {
    "llava": "model.language_model.",
    "idefics3": "model.text_model.",
    "gemma3": "model.language_model.",
}
GEMMA3_DEFAULT_SCALE = 4  # llama.cpp's pooling when the file states none (the real 4B's)
CONTROL, NORMAL = 3, 1  # llama.cpp's token types


def write_pair(
    folder: Path, out: Path, matrix_type: str = "F32", text_type: str = "F32"
) -> tuple[Path, Path, dict]:
    """`folder`'s text GGUF (its matrices in `text_type`) and mmproj GGUF (in
    `matrix_type`) in `out`; returns their paths and what the mmproj's tensors decode to,
    under the HF model's parameter names."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    family = model.config.model_type
    text_path, mmproj_path = out / "text.gguf", out / "mmproj-text.gguf"
    write_text_gguf(text_path, model, tokenizer, text_type)
    expected = write_mmproj(mmproj_path, model, folder, family, matrix_type)
    return text_path, mmproj_path, expected


def write_text_gguf(path: Path, vlm, tokenizer, matrix_type: str = "F32") -> dict:
    """The VLM's language model as a llama (Gemma 3: gemma3) GGUF, its matrices in
    `matrix_type`, with the folder's tokenizer; returns what the file de-quantizes to
    (causal-LM names)."""
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM

    config = vlm.config.get_text_config()
    gemma3 = vlm.config.model_type == "gemma3"
    arch = "gemma3" if gemma3 else "llama"
    text = (Gemma3ForCausalLM if gemma3 else LlamaForCausalLM)(config).eval()
    prefix = TEXT_PREFIX[vlm.config.model_type]
    state = {
        "model." + name.removeprefix(prefix): tensor
        for name, tensor in vlm.state_dict().items()
        if name.startswith(prefix)
    }
    text.load_state_dict(state | {"lm_head.weight": vlm.lm_head.weight}, strict=True)
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if gemma3:  # the full layers' base; the sliding ones' is llama.cpp's fixed 10000
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    _add_tokenizer(writer, tokenizer, config.vocab_size)
    expected = _add_tensors(writer, text, matrix_type, arch, {})
    _finish(writer)
    return expected


def _add_tokenizer(writer: GGUFWriter, tokenizer, vocab_size: int) -> None:
    """The folder's byte-level BPE: its tokens by id (padded to the embedding table), its
    merges, its added tokens as control tokens, its chat template."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    added = set(tokenizer.added_tokens_decoder)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_token_types([CONTROL if i in added else NORMAL for i in range(len(tokens))])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.unk_token_id is not None:  # Gemma's reader builds a tokenizer around it
        writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def write_mmproj(path: Path, vlm, folder: Path, family: str, matrix_type: str) -> dict:
    """The VLM's vision encoder and projector as llama.cpp's mmproj file; returns the
    tensors it decodes to under the HF parameter names."""
    vision = vlm.config.vision_config
    processor = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    llava = family == "llava"
    # LLaVA's feature layer -2: the converter keeps all but the last block
    blocks = vision.num_hidden_layers - 1 if llava else vision.num_hidden_layers
    writer = GGUFWriter(str(path), "clip")
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(PROJECTOR[family])
    writer.add_vision_image_size(vision.image_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(blocks)
    writer.add_vision_head_count(vision.num_attention_heads)
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_image_mean(processor["image_mean"])
    writer.add_vision_image_std(processor["image_std"])
    writer.add_vision_use_gelu(not llava)  # CLIP's quick GELU; SigLIP's tanh GELU
    writer.add_vision_projection_dim(vlm.config.get_text_config().hidden_size)
    if family == "idefics3":
        writer.add_vision_projector_scale_factor(vlm.config.scale_factor)
        writer.add_vision_preproc_image_size(processor["size"]["longest_edge"])
    if family == "gemma3":  # the pooling: patches a side over soft tokens a side
        side = int(vlm.config.mm_tokens_per_image**0.5)
        scale = vision.image_size // vision.patch_size // side
        if scale != GEMMA3_DEFAULT_SCALE:
            writer.add_vision_projector_scale_factor(scale)
    expected = {}
    for hf_name, tensor in vlm.state_dict().items():
        gguf_name = _mmproj_name(hf_name, family, blocks)
        if gguf_name is None:
            continue
        if gguf_name == "mm.soft_emb_norm.weight":  # Gemma's (1 + w) norm, stored as 1 + w
            expected[hf_name] = _add(writer, gguf_name, tensor.numpy() + 1, matrix_type) - 1
        else:
            expected[hf_name] = _add(writer, gguf_name, tensor.numpy(), matrix_type)
    _finish(writer)
    return expected


def _mmproj_name(hf_name: str, family: str, blocks: int) -> str | None:
    """llama.cpp's name of an HF vision / projector parameter (None: not in the file)."""
    top = "model.vision_model." if family == "idefics3" else "model.vision_tower."
    if hf_name.startswith(top):
        name = hf_name.removeprefix(top)
        if family == "llava" and name.startswith("post_layernorm"):
            return None
        if name.startswith("encoder.layers."):
            block, rest = name.removeprefix("encoder.layers.").split(".", 1)
            part, kind = rest.rsplit(".", 1)
            return (
                f"v.blk.{block}.{_BLOCK_PARTS[family][part]}.{kind}"
                if int(block) < blocks
                else None
            )
        return _TOP_PARTS[name]
    projectors = {
        "model.multi_modal_projector.linear_1.": "mm.0.",
        "model.multi_modal_projector.linear_2.": "mm.2.",
        "model.connector.modality_projection.proj.": "mm.model.fc.",
        # Gemma 3's projection is a bare [vision, text] parameter, stored as it is
        "model.multi_modal_projector.mm_input_projection_weight": "mm.input_projection.weight",
        "model.multi_modal_projector.mm_soft_emb_norm.": "mm.soft_emb_norm.",
    }
    for prefix, gguf_prefix in projectors.items():
        if hf_name.startswith(prefix):
            return gguf_prefix + hf_name.removeprefix(prefix)
    return None


_COMMON_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
}
_BLOCK_PARTS = {
    # the legacy LLaVA converter's names: fc1 as ffn_down, fc2 as ffn_up
    "llava": _COMMON_BLOCK | {"mlp.fc1": "ffn_down", "mlp.fc2": "ffn_up"},
    "idefics3": _COMMON_BLOCK | {"mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"},
    "gemma3": _COMMON_BLOCK | {"mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"},
}
_TOP_PARTS = {
    "embeddings.class_embedding": "v.class_embd",
    "embeddings.patch_embedding.weight": "v.patch_embd.weight",
    "embeddings.patch_embedding.bias": "v.patch_embd.bias",
    "embeddings.position_embedding.weight": "v.position_embd.weight",
    "pre_layrnorm.weight": "v.pre_ln.weight",
    "pre_layrnorm.bias": "v.pre_ln.bias",
    "post_layernorm.weight": "v.post_ln.weight",
    "post_layernorm.bias": "v.post_ln.bias",
}


def _add(writer: GGUFWriter, name: str, array: np.ndarray, matrix_type: str) -> torch.Tensor:
    """A 2-D weight in `matrix_type`, anything else F32 (llama.cpp's converters keep
    vectors and, for SmolVLM, embeddings in F32); returns the values the file holds."""
    array = array.astype(np.float32)
    if array.ndim != 2 or matrix_type == "F32" or "embd" in name:
        writer.add_tensor(name, array)
        return torch.from_numpy(array.copy())
    qtype = GGMLQuantizationType[matrix_type]
    blocks = quantize(array, qtype)
    writer.add_tensor(name, blocks, raw_dtype=qtype)
    return torch.from_numpy(dequantize(blocks, qtype).reshape(array.shape).astype(np.float32))


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
