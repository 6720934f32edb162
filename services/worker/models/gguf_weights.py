"""Checkpoint tensors read straight from a GGUF file, under their HF names (Llama family,
Qwen2, Qwen3, Gemma 3, Phi-3, Qwen2-MoE, Qwen3-MoE). Quantized matrices come as
`MappedBlocks` (still in the file's map, decoded when their layer is finished) or, unless
`quantized`, de-quantized to float32; float tensors as float32. The "llama" family's
rotary-permuted query / key rows are put back in HF's order, Gemma's 1 + w norms back to
w, and a mixture's stacked experts split into one tensor per expert.
"""

from __future__ import annotations

import logging
import os
import re
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from services.common.gguf_conversion import GGUF_NATIVE_ARCHITECTURES, TEXT_GGUF_FILE, text_gguf_of
from services.common.gguf_file import GGUFFile, GGUFTensor
from services.common.model_errors import ModelLoadError
from services.worker.layers.quantization import UnsupportedQuantization, gguf_float
from services.worker.layers.quantization.mapped_blocks import MappedBlocks
from services.worker.models.load_progress import LoadProgress

logger = logging.getLogger(__name__)

# Only "llama" (smollm files carry it too), "mistral" and "smollm3" files hold permuted
# query / key rows (llama.cpp's converter permutes them for its rotary kernels).
PERMUTED_ARCHITECTURES = ("llama", "mistral", "smollm3")
FLOAT_TYPES = ("F32", "F16", "BF16")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    # mixtures of experts: the router, Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A mixture's experts, stacked in one 3D tensor per projection [experts, rows, K]: split
# into one tensor per expert (a view of its rows' bytes) under HF's per-expert names.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Read as float32 whatever the file stores: the router and the shared expert's gate.
_FLOAT_MODULES = ("mlp.gate.", "mlp.shared_expert_gate.")
# Gemma 3 names its four norms apart: ffn_norm is the MLP's input norm there.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 stores its fused checkpoint tensors as they are: qkv rows, gate then up rows.
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}
UNIT_OFFSET_NORM_ARCHITECTURES = ("gemma3",)
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_PATTERN = re.compile(r"(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """ "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight" (under the names of
    `arch`'s HF model); None for tensors the HF model does not have (rope_freqs:
    recomputed from the config)."""
    layer = _LAYER_PATTERN.match(gguf_name)
    if layer is not None:
        index, kind, param = layer.groups()
        module = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES).get(kind)
        return None if module is None else f"model.layers.{index}.{module}.{param}"
    top = _GLOBAL_PATTERN.match(gguf_name)
    if top is not None and top.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[top.group(1)]}.{top.group(2)}"
    return None


def _rotary_order(rows: int, heads: int) -> torch.Tensor:
    """Index i of HF's row order -> the GGUF row that holds it (llama.cpp's permutation of
    each head's rows into interleaved rotary pairs, undone)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def _heads_of(kind: str, config: PretrainedConfig) -> int | None:
    if kind == "attn_q":
        return int(config.num_attention_heads)
    if kind == "attn_k":
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return None


def _read_tensor(gguf: GGUFFile, tensor: GGUFTensor, quantized: bool):
    """A tensor's bytes (uint8 [rows, row bytes], a view of the file's map): quantized
    ones kept as MappedBlocks (decoded when their layer is finished) or de-quantized,
    float tensors read as float32 (the map's pages handed back after a copy)."""
    raw, type_name, shape = gguf.raw(tensor), tensor.type_name, tensor.shape
    if quantized and type_name not in FLOAT_TYPES:
        return MappedBlocks(raw, type_name, shape[-1], gguf.release)
    if type_name in FLOAT_TYPES:
        value = gguf_float(raw, type_name, shape)
    else:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(raw, GGMLQuantizationType[type_name])
        value = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
    gguf.release(raw)
    return value


def iterate_gguf_weights(
    path: Path,
    config: PretrainedConfig,
    quantized: bool,
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | MappedBlocks]]:
    """(HF name, tensor) for every tensor of `path` the HF model has; `wanted(name)` False
    skips a tensor without decoding it. Raises ModelLoadError for an architecture outside
    the native family or, when `quantized`, a block type our kernels do not run."""
    gguf = GGUFFile(path)  # a malformed file: GGUFError, a ModelLoadError naming the field
    arch = gguf.architecture
    if arch not in GGUF_NATIVE_ARCHITECTURES:
        raise ModelLoadError(
            f"{path} is a {arch!r} GGUF; pagestream loads GGUF files of the native family "
            f"({', '.join(GGUF_NATIVE_ARCHITECTURES)})."
        )
    chosen = []
    for tensor in gguf.tensors:
        for name, part in _parts(tensor, arch):
            if name is None:
                logger.debug("GGUF tensor %s has no HF counterpart; skipped", tensor.name)
            elif wanted is None or wanted(name):
                chosen.append((name, part))
    # decoded a few tensors ahead on a small pool (numpy's array operations release the
    # interpreter lock), yielded in file order
    progress = LoadProgress(path.name, sum(tensor.nbytes for _, tensor in chosen))
    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        pending: deque = deque()  # (name, tensor, future), at most 2 * DECODE_THREADS ahead
        for name, tensor in chosen:
            keep = quantized and not _read_as_float(name)
            pending.append((name, tensor, pool.submit(_decoded, gguf, tensor, keep, config)))
            if len(pending) > 2 * DECODE_THREADS:
                yield _oldest(pending, progress)
        while pending:
            yield _oldest(pending, progress)
    progress.done()


def _parts(tensor: GGUFTensor, arch: str) -> Iterator[tuple[str | None, GGUFTensor]]:
    """(HF name, tensor) for a file's tensor: itself, or for a stacked experts tensor
    ("blk.3.ffn_up_exps.weight" [E, I, K]) each expert's rows as a tensor of their own
    ("model.layers.3.mlp.experts.<e>.up_proj.weight" [I, K])."""
    layer = _LAYER_PATTERN.match(tensor.name)
    if layer is None or layer.group(2) not in _EXPERT_NAMES or len(tensor.shape) != 3:
        yield hf_name(tensor.name, arch), tensor
        return
    index, kind, param = layer.groups()
    experts = tensor.shape[0]
    size = tensor.nbytes // experts
    for e in range(experts):
        name = f"model.layers.{index}.mlp.experts.{e}.{_EXPERT_NAMES[kind]}.{param}"
        part = replace(
            tensor,
            name=f"{tensor.name}[{e}]",
            shape=tensor.shape[1:],
            offset=tensor.offset + e * size,
            nbytes=size,
        )
        yield name, part


def _read_as_float(name: str) -> bool:
    """Whether parameter `name` is read as float32 whatever the file stores."""
    return any(f".{module}" in name for module in _FLOAT_MODULES)


def _oldest(pending: deque, progress: LoadProgress) -> tuple[str, object]:
    """The first submitted tensor, decoded (waiting for it), counted as read."""
    name, tensor, future = pending.popleft()
    value = future.result()
    progress.add(tensor.nbytes)
    return name, value


DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))


def _decoded(gguf: GGUFFile, tensor: GGUFTensor, quantized: bool, config: PretrainedConfig):
    """One tensor decoded (and its query / key rows put back in HF's order)."""
    try:
        value = _read_tensor(gguf, tensor, quantized)
    except UnsupportedQuantization as exc:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name} is {tensor.type_name}, which pagestream's "
            f"kernels do not run ({exc}); load it de-quantized with --quantization none "
            "(and an explicit --dtype)."
        ) from exc
    kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    heads = _heads_of(kind, config)
    if heads is not None and gguf.architecture in PERMUTED_ARCHITECTURES:
        order = _rotary_order(value.shape[0], heads)
        value = value[order] if isinstance(value, torch.Tensor) else value.select_rows(order)
    if gguf.architecture in UNIT_OFFSET_NORM_ARCHITECTURES and tensor.name.endswith("norm.weight"):
        value = value - 1.0  # stored as 1 + w
    if kind == "ffn_gate_inp_shexp":  # [hidden] in the file, HF's Linear(hidden, 1)
        value = value.reshape(1, -1)
    return value


def dequantized_folder(name_or_path: str | Path) -> Path:
    """An HF folder with float32 weights for a model name: its own folder when it has
    weights, else (a GGUF model of the native family, or llama.cpp's pair's VLM folder) a
    copy of its converted folder with the file's tensors de-quantized into
    model.safetensors (a pair's beside its vision weights), written once next to it. For
    what needs a complete HF checkpoint: transformers as a reference, HF baselines."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from services.common.gguf_vlm import text_weights
    from services.common.model_source import gguf_source, resolve_model

    folder = resolve_model(name_or_path)
    pair = text_gguf_of(folder)
    gguf = gguf_source(name_or_path) or pair
    if gguf is None or (pair is None and any(folder.glob("*.safetensors"))):
        return folder
    out = folder.with_name(folder.name + ".dequantized")
    marker = out / "pagestream_dequantized.json"
    fingerprint = f"{gguf.resolve()} {gguf.stat().st_size}"
    if marker.is_file() and marker.read_text() == fingerprint:
        return out
    config = AutoConfig.from_pretrained(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=folder.parent))
    try:
        shutil.copytree(folder, tmp, dirs_exist_ok=True)
        text = config.get_text_config()
        tensors = {name: t.contiguous() for name, t in iterate_gguf_weights(gguf, text, False)}
        if pair is not None:  # the VLM's names; its vision weights as the folder has them
            tensors = text_weights(config, tensors) | load_file(folder / "model.safetensors")
            (tmp / TEXT_GGUF_FILE).unlink()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / marker.name).write_text(fingerprint)
        tmp.chmod(0o755)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
