"""A loaded model's weights as a whole: online quantization switched on for every layer
that takes it, the quantized shards joined after loading, the fallback that de-quantizes
them for paths without a quantized kernel, and what the log and the model info report
(each tensor kind's format and the resident weight bytes)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from services.worker.layers.quantization.loading import OnlineQuantization

logger = logging.getLogger(__name__)


def _loading_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "finish_loading")]


def set_online_quantization(model: nn.Module, online: OnlineQuantization) -> None:
    """Every linear and the LM head quantize their float checkpoint tensors at load."""
    for module in _loading_modules(model):
        module.online = online


def finish_loading(model: nn.Module) -> None:
    """Joins each layer's quantized shards (after every checkpoint tensor is in)."""
    for module in _loading_modules(model):
        module.finish_loading()


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """Float weights back from the quantized ones, for the torch modules (other devices, or
    no native CPU step); returns how many tensors it de-quantized."""
    count = 0
    for module in model.modules():
        if getattr(module, "quantized", None) is not None:
            module.dequantize_weight(dtype)
            count += 1
    if count:
        logger.info(
            "quantized weights de-quantized to %s at load (%d tensors): this path has no "
            "quantized kernel, so they take %s's memory and speed",
            str(dtype).removeprefix("torch."),
            count,
            str(dtype).removeprefix("torch."),
        )
    return count


def weight_formats(model: nn.Module) -> dict[str, str]:
    """Tensor kind (qkv_proj, lm_head, embed_tokens, ...) -> the format(s) it is held in."""
    formats: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "quantized") or weight is None:
            continue
        quantized = module.quantized
        native = getattr(module, "native", None)
        if quantized is not None:
            held = quantized.source
        elif native is not None:
            held = native.format()
        else:
            held = str(weight.dtype).removeprefix("torch.")
        formats.setdefault(name.rsplit(".", 1)[-1], set()).add(held)
    return {kind: "+".join(sorted(held)) for kind, held in formats.items()}


def quantization_name(formats: dict[str, str]) -> str:
    """What the model info reports: the quantized formats in use ("Q4_1+Q8_0", "int8"),
    or "none"."""
    floats = ("float32", "bfloat16", "float16")
    held = {part for value in formats.values() for part in value.split("+")}
    quantized = sorted(held - set(floats))
    return "+".join(quantized) if quantized else "none"


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: its torch parameters (the ones packed into a
    native copy are freed), the quantized tensors still in torch, and the native copies."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    seen: set[int] = set()
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if quantized is not None and id(quantized) not in seen:
            seen.add(id(quantized))
            total += quantized.nbytes
        native = getattr(module, "native", None)
        if native is not None:
            total += int(native.weight_bytes())
        packed = getattr(module, "packed", None)  # oneDNN's copy (PackedWeight)
        if packed is not None and packed.replaces_plain:
            total += packed.tensor.numel() * packed.tensor.element_size()
    return total
