"""A PEFT LoRA folder checked against the base model, without loading its tensors.

Torch-free: the frontend checks an adapter before any request uses it. Every read is
bounded before it is made (MAX_CONFIG_BYTES, MAX_HEADER_BYTES, and weights exactly the
header's tensors end to end), so the digest never reads more than the model's targets at
max_lora_rank can need.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from services.common.lora_config import TARGET_MODULES, LoRAConfig, LoRATargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT writes a config of about a kilobyte; a megabyte leaves room for any real one.
MAX_CONFIG_BYTES = 1 << 20
# A header entry is about 200 bytes: 16 MiB is some 80,000 tensors, far over the
# 2 x 7 x layers of any adapter served.
MAX_HEADER_BYTES = 16 << 20
# safetensors' float dtypes, in bytes per element (the worker reads them as float32).
DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name such
# as ".default" before ".weight" in older saves)
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


class LoRAAdapterError(ValueError):
    """An adapter the engine refuses; the message names the problem."""


@dataclass(frozen=True)
class AdapterSpec:
    path: str
    rank: int
    scale: float
    # (layer, HF module name) pairs the adapter changes
    targets: frozenset[tuple[int, str]]
    digest: str

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.targets}


def inspect_adapter(path: str, config: LoRAConfig, model: LoRATargets) -> AdapterSpec:
    """The adapter in `path`, checked against the engine's limits and the base model's
    target linears (LoRAAdapterError naming what does not fit).

    Reads adapter_config.json and the safetensors header (names and shapes only), and
    refuses anything the engine could not apply exactly as PEFT does: missing files, a
    rank over max_lora_rank, a target the model lacks or the engine does not serve
    (embeddings, the LM head, DoRA, biases, modules_to_save), shapes of another base
    model, weights that are not float tensors laid end to end. The scale is PEFT's:
    lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"the LoRA adapter folder {path!r} does not exist.")
    peft = _read_config(folder)
    rank = _rank(peft, config, path)
    header, data_start, file_size = _read_header(folder, path)
    targets = _check_tensors(header, rank, model, path)
    _check_layout(header, file_size - data_start, path)
    alpha = peft.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"{path}: lora_alpha must be a number, got {alpha!r}.")
    scale = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    digest = _digest(folder, file_size)
    return AdapterSpec(str(folder), rank, float(scale), frozenset(targets), digest)


def _read_config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"{folder}: {CONFIG_FILE} is missing (not a PEFT LoRA folder).")
    try:
        with file.open("rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"over {MAX_CONFIG_BYTES} bytes")
        peft = json.loads(text)
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{file}: not readable JSON ({exc}).") from exc
    if not isinstance(peft, dict):
        raise LoRAAdapterError(f"{file}: expected a JSON object.")
    kind = peft.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAAdapterError(f"{folder}: peft_type is {kind!r}; only LORA adapters are served.")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "modules_to_save (fully trained modules) are not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "fan_in_fan_out": "fan_in_fan_out weights (Conv1D models) are not supported",
        "layer_replication": "layer_replication is not supported",
        "trainable_token_indices": "trainable token embeddings are not supported",
        "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
        "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    }
    for key, why in refusals.items():
        if peft.get(key):
            raise LoRAAdapterError(f"{folder}: {why} ({key} = {peft[key]!r}).")
    if peft.get("bias", "none") != "none":
        raise LoRAAdapterError(
            f"{folder}: bias = {peft['bias']!r}; only adapters without biases are served."
        )
    return peft


def _rank(peft: dict, config: LoRAConfig, path: str) -> int:
    rank = peft.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"{path}: r must be an integer >= 1, got {rank!r}.")
    if rank > config.max_lora_rank:
        raise LoRAAdapterError(
            f"{path}: the adapter's rank {rank} is over max_lora_rank ({config.max_lora_rank}); "
            "start the engine with a larger --max-lora-rank."
        )
    return rank


def _read_header(folder: Path, path: str) -> tuple[dict, int, int]:
    """The safetensors header (without __metadata__), where its data starts, and the
    file's size."""
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        extra = " (adapter_model.bin is not read: save it with safe_serialization)"
        has_bin = (folder / "adapter_model.bin").is_file()
        raise LoRAAdapterError(f"{path}: {WEIGHTS_FILE} is missing{extra if has_bin else ''}.")
    try:
        with file.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, struct.error) as exc:
        raise LoRAAdapterError(f"{file}: not a safetensors file ({exc}).") from exc
    header.pop("__metadata__", None)
    return header, 8 + length, size


def _check_tensors(header: dict, rank: int, model: LoRATargets, path: str) -> set[tuple[int, str]]:
    found: dict[tuple[int, str], dict[str, list[int]]] = {}
    for name, entry in header.items():
        match = _KEY.search(name)
        if match is None:
            raise LoRAAdapterError(
                f"{path}: tensor {name!r} is not a LoRA A/B weight of a decoder layer's "
                f"{'/'.join(TARGET_MODULES)} (embeddings, the LM head and biases are not served)."
            )
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in model.modules:
            raise LoRAAdapterError(
                f"{path}: the adapter targets {module!r}, which the model does not have "
                f"(targets: {', '.join(sorted(model.modules))})."
            )
        if layer >= model.num_layers:
            raise LoRAAdapterError(
                f"{path}: tensor {name!r} is for layer {layer}; the model has "
                f"{model.num_layers} layers."
            )
        shape = entry.get("shape") if isinstance(entry, dict) else None
        found.setdefault((layer, module), {})[which] = shape if isinstance(shape, list) else []
    if not found:
        raise LoRAAdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights.")
    for (layer, module), shapes in sorted(found.items()):
        in_features, out_features = model.modules[module]
        want = {"A": [rank, in_features], "B": [out_features, rank]}
        for which, shape in want.items():
            if shapes.get(which) != shape:
                raise LoRAAdapterError(
                    f"{path}: layer {layer} {module}.lora_{which} has shape "
                    f"{shapes.get(which, 'missing')}, the base model needs {shape} "
                    "(an adapter of another base model, or another rank than r)."
                )
    return set(found)


def _check_layout(header: dict, data_bytes: int, path: str) -> None:
    """The tensors (their shapes already checked) tile the data exactly, as safetensors
    requires: each a float dtype, [begin, end) its size, in order, ending at the file's end."""
    spans = []
    for name, entry in header.items():
        dtype, offsets = entry.get("dtype"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise LoRAAdapterError(
                f"{path}: tensor {name!r} has dtype {dtype!r}; LoRA weights must be one of "
                f"{', '.join(DTYPE_BYTES)}."
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise LoRAAdapterError(
                f"{path}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end]."
            )
        size = math.prod(entry["shape"]) * DTYPE_BYTES[dtype]
        spans.append((offsets[0], offsets[1], size, name))
    end = 0
    for begin, stop, size, name in sorted(spans):
        if begin != end or stop - begin != size:
            raise LoRAAdapterError(
                f"{path}: tensor {name!r} has data_offsets [{begin}, {stop}]; its "
                f"{size} bytes must start at {end} (the tensors laid end to end)."
            )
        end = stop
    if end != data_bytes:
        raise LoRAAdapterError(
            f"{path}: {WEIGHTS_FILE} holds {data_bytes} bytes of data; its tensors take {end}."
        )


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _digest(folder: Path, weights_size: int) -> str:
    """sha256 of the config and the weights; the weights are read up to the size that was
    checked (a file grown since reads no further and is refused)."""
    h = hashlib.sha256()
    for name, limit in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, weights_size)):
        read = 0
        with (folder / name).open("rb") as f:
            while read <= limit and (chunk := f.read(min(1 << 20, limit + 1 - read))):
                read += len(chunk)
                h.update(chunk)
        if read > limit:
            raise LoRAAdapterError(f"{folder / name}: the file grew while it was checked.")
    return h.hexdigest()[:16]
