"""Tiny HF models written as llama.cpp GGUF files (every block format the kernels run, MoE
tensors stacked as llama.cpp stacks them), and the HF folder with the weights such a file
de-quantizes to, which is the reference a quantized model is compared with."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
)
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from transformers.convert_slow_tokenizer import bytes_to_unicode

from services.common import gguf_conversion
from tests.helpers.model_cache import isolated_model_cache
from tests.helpers.tiny_models import build_tiny_model


def write_tiny_gguf(
    path: Path,
    hf_model,
    matrix_type: str | None = None,
    arch: str = "llama",
    overrides: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Write `hf_model` (a tiny Llama, Qwen2, Qwen3, Gemma 3 or Phi-3) as a llama.cpp GGUF
    with a byte-level BPE tokenizer.

    By default the MLP weights are stored as Q8_0 so conversion really dequantizes; with
    `matrix_type` every matrix (embedding included) is stored in that GGUF type (but those
    whose name holds a key of `overrides`, in its type: llama.cpp's mixes): gguf's
    own quantization of the weight for Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, random blocks
    with small scales for the others (gguf cannot quantize them). Returns the tensors (HF
    names, float32) the file de-quantizes to."""
    config = hf_model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # Qwen2-MoE / Qwen3-MoE, Mixtral (a "llama" file with experts)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        if shared:
            writer.add_expert_shared_feed_forward_length(shared)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch != "gemma3":  # Gemma 3: per layer type (below)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "phi3":  # the rotated share of a head; longrope's factors as tensors
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for kind in ("long", "short"):
                factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    byte_tokens = list(bytes_to_unicode().values())
    merges = [("h", "i"), ("Ġ", "t"), ("Ġt", "hi")]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *("".join(pair) for pair in merges)]
    tokens += [f"<extra_{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    expected = _add_tensors(writer, hf_model, matrix_type, arch, overrides or {})
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":  # llama.cpp's converter: a tensor of factors only
        factors = gguf_conversion.llama3_factors(
            head_dim,
            rope["rope_theta"],
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# The types gguf cannot quantize, written as random blocks: (offset, count) of their
# float16 (super-)block scales (d, dmin).
RANDOM_BLOCK_FP16 = {
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, 1),
    "Q2_K": (80, 2),
    "Q3_K": (108, 1),
    "IQ4_NL": (0, 1),
    "IQ4_XS": (0, 1),
    "IQ2_XXS": (0, 1),
}


def _random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a type gguf cannot quantize, with small (super-)block scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    start, count = RANDOM_BLOCK_FP16[type_name]
    scales = (rng.random((rows, cols // block, count)) * 4e-3 + 1e-3).astype(np.float16)
    blocks[..., start : start + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _matrix_blocks(array: np.ndarray, type_name: str, seed: int) -> np.ndarray:
    if type_name in RANDOM_BLOCK_FP16:
        return _random_blocks(type_name, array.shape[0], array.shape[1], seed)
    return quantize(array, GGMLQuantizationType[type_name])


_SHARED_EXPERT_KINDS = {
    "gate_proj": "ffn_gate_shexp",
    "up_proj": "ffn_up_shexp",
    "down_proj": "ffn_down_shexp",
}


def _add_moe_tensor(
    writer: GGUFWriter, name: str, array: np.ndarray, type_name: str, seed: int
) -> dict[str, np.ndarray]:
    """A mixture's tensor as llama.cpp writes it: the router F32 (ffn_gate_inp), the
    experts stacked [E, rows, K] per projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps)
    and the shared expert (ffn_*_shexp) in `type_name`, the shared expert's gate F32
    [hidden]. Returns what the file de-quantizes to under HF's per-expert names."""
    layer = name.split(".")[2]
    blk = f"blk.{layer}"
    if name.endswith(".mlp.gate.weight"):
        writer.add_tensor(f"{blk}.ffn_gate_inp.weight", array)
        return {name: array}
    if name.endswith("shared_expert_gate.weight"):
        writer.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight", array.reshape(-1))
        return {name: array}
    if ".shared_expert." in name:
        kind = _SHARED_EXPERT_KINDS[name.split(".")[-2]]
        return {name: _add_matrix(writer, f"{blk}.{kind}.weight", array, type_name, seed)}
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, K]: gate rows, then up rows
        gate, up = np.split(array, 2, axis=1)
        parts = {"gate_proj": ("ffn_gate_exps", gate), "up_proj": ("ffn_up_exps", up)}
    else:
        parts = {"down_proj": ("ffn_down_exps", array)}
    expected = {}
    for proj, (kind, stacked) in parts.items():
        values = _add_matrix(writer, f"{blk}.{kind}.weight", stacked, type_name, seed)
        for e, value in enumerate(values):
            expected[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = value
    return expected


def _add_matrix(
    writer: GGUFWriter, gguf_name: str, array: np.ndarray, type_name: str, seed: int
) -> np.ndarray:
    """`array` ([rows, K], or [E, rows, K] stacked) written in `type_name`; returns its
    de-quantized values."""
    flat = array.reshape(-1, array.shape[-1])
    qtype = GGMLQuantizationType[type_name]
    blocks = _matrix_blocks(np.ascontiguousarray(flat), type_name, seed)
    writer.add_tensor(gguf_name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=qtype)
    return dequantize(blocks, qtype).reshape(array.shape)


def _add_tensors(
    writer: GGUFWriter, hf_model, matrix_type: str | None, arch: str, overrides: dict[str, str]
) -> dict[str, np.ndarray]:
    config = hf_model.config
    model_arch = {
        "llama": MODEL_ARCH.LLAMA,
        "qwen2": MODEL_ARCH.QWEN2,
        "qwen3": MODEL_ARCH.QWEN3,
        "gemma3": MODEL_ARCH.GEMMA3,
        "phi3": MODEL_ARCH.PHI3,
        "smollm3": MODEL_ARCH.SMOLLM3,
        "qwen2moe": MODEL_ARCH.QWEN2MOE,
        "qwen3moe": MODEL_ARCH.QWEN3MOE,
    }[arch]
    name_map = get_tensor_name_map(model_arch, config.num_hidden_layers)
    expected = {}
    for index, (name, tensor) in enumerate(hf_model.state_dict().items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied
        base, suffix = name.rsplit(".", 1)
        array = tensor.numpy().astype(np.float32)
        if ".mlp.experts." in name or ".mlp.gate." in name or ".mlp.shared_expert" in name:
            expected.update(_add_moe_tensor(writer, name, array, matrix_type or "Q8_0", index))
            continue
        expected[name] = array
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for proj, num_heads in heads.items():
            if base.endswith(proj) and arch in (
                "llama",
                "smollm3",
            ):  # llama.cpp's rotary permutation
                array = array.reshape(num_heads, 2, -1, *array.shape[1:]).swapaxes(1, 2)
                array = array.reshape(expected[name].shape)
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        if arch == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's (1 + w) norms as 1 + w
            writer.add_tensor(gguf_name, array + np.float32(1.0))
            continue
        type_name = matrix_type if array.ndim == 2 else None
        if matrix_type is None and ".mlp." in name:
            type_name = "Q8_0"
        if array.ndim == 2:  # a mix: the type of the first part of the name that has one
            type_name = next((t for part, t in overrides.items() if part in name), type_name)
        if type_name is None:
            writer.add_tensor(gguf_name, array)
            continue
        qtype = GGMLQuantizationType[type_name]
        blocks = _matrix_blocks(array, type_name, seed=index)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        values = dequantize(blocks, qtype).reshape(array.shape)
        if base.endswith(("q_proj", "k_proj")) and arch in (
            "llama",
            "smollm3",
        ):  # back into HF's order
            num_heads = heads[base.rsplit(".", 1)[-1]]
            values = values.reshape(num_heads, -1, 2, values.shape[1]).swapaxes(1, 2)
            values = values.reshape(array.shape)
        expected[name] = values
    return expected


def tiny_gguf_file(tmp_path: Path, monkeypatch, matrix_type: str) -> Path:
    """A tiny tied Llama as a GGUF file with every matrix in `matrix_type`, converted under
    an isolated $PAGESTREAM_CACHE (sharing the built kernels)."""
    isolated_model_cache(tmp_path / "cache", monkeypatch)
    path = tmp_path / f"tiny.{matrix_type}.gguf"
    write_tiny_gguf(path, build_tiny_model("llama_tied", seed=3, vocab_size=300), matrix_type)
    return path


def reference_folder(folder: Path, tensors: dict, out: Path) -> Path:
    """`folder` (config, tokenizer) with `tensors` as its weights: what HF runs."""
    shutil.copytree(folder, out)
    weights = {name: torch.as_tensor(t).float().contiguous() for name, t in tensors.items()}
    save_file(weights, out / "model.safetensors")
    return out
