"""A loaded model's weights as a whole: online quantization switched on for every layer
that takes it, the quantized shards joined after loading, the torch path's form of every
weight (de-quantized where no quantized kernel runs, oneDNN-packed), and what the log and
the model info report (each tensor kind's format and the resident weight bytes).

Linears hold one weight-format object each (services/worker/layers/linear_weight.py); the
token embedding and the LM head keep their table in their own module
(services/worker/layers/vocab_embedding.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from services.worker.layers.linear import LinearBase
from services.worker.layers.packed_weight import PackedWeight, packing_enabled
from services.worker.layers.quantization.loading import OnlineQuantization
from services.worker.layers.vocab_embedding import LMHead, VocabEmbedding

logger = logging.getLogger(__name__)


def _linears(model: nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def _heads(model: nn.Module) -> list[LMHead]:
    return [m for m in model.modules() if isinstance(m, LMHead)]


def set_online_quantization(model: nn.Module, online: OnlineQuantization) -> None:
    """Every linear and the LM head quantize their float checkpoint tensors at load."""
    for linear in _linears(model):
        linear.quantize_online(online)
    for head in _heads(model):
        head.online = online


def finish_loading(model: nn.Module) -> None:
    """After every checkpoint tensor is in: each linear's shards checked (their final form
    is made later, one layer at a time), each head's table settled, and the quantized
    tables of embeddings that no head shares decoded for their lookups."""
    heads = _heads(model)
    for module in [*_linears(model), *heads]:
        module.finish_loading()
    shared = {id(head.tied) for head in heads if head.tied is not None}
    for table in model.modules():
        if type(table) is VocabEmbedding and id(table) not in shared:
            table.finish_loading()


def prepare_for_torch(model: nn.Module, dtype: torch.dtype) -> None:
    """The torch modules' form of every weight (other devices, or no native CPU step):
    quantized ones de-quantized to `dtype` (the torch path has no quantized kernel), float
    ones packed into oneDNN's layout on the CPU."""
    linears = _linears(model)
    tables = [m for m in model.modules() if isinstance(m, VocabEmbedding)]
    dequantized = sum(m.builder is not None and m.builder.quantized for m in linears)
    dequantized += sum(m.quantized is not None for m in tables)
    for linear in linears:
        linear.prepare_for_torch(dtype)
    for table in tables:
        table.dequantize_weight(dtype)
    if packing_enabled():
        for head in _heads(model):
            head.pack()
    if dequantized:
        name = str(dtype).removeprefix("torch.")
        logger.info(
            "quantized weights de-quantized to %s at load (%d tensors): this path has no "
            "quantized kernel, so they take %s's memory and speed",
            name,
            dequantized,
            name,
        )


def _table_format(table: VocabEmbedding) -> str:
    if table.quantized is not None:
        return table.quantized.source
    if isinstance(table, LMHead) and table.native is not None:
        return table.native.format()
    return str(table.weight.dtype).removeprefix("torch.")


def weight_formats(model: nn.Module) -> dict[str, str]:
    """Tensor kind (qkv_proj, lm_head, embed_tokens, ...) -> the format(s) it is held in."""
    formats: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            held = module.format
        elif isinstance(module, VocabEmbedding):
            held = _table_format(module)
        else:
            continue
        formats.setdefault(name.rsplit(".", 1)[-1], set()).update(held.split("+"))
    return {kind: "+".join(sorted(held)) for kind, held in formats.items()}


def quantization_name(formats: dict[str, str]) -> str:
    """What the model info reports: the quantized formats in use ("Q4_1+Q8_0", "int8"),
    or "none"."""
    floats = ("float32", "bfloat16", "float16")
    held = {part for value in formats.values() for part in value.split("+")}
    quantized = sorted(held - set(floats))
    return "+".join(quantized) if quantized else "none"


def bytes_by_format(model: nn.Module) -> dict[str, int]:
    """The linears' resident bytes by the format they are held in (a fused layer whose
    parts differ counts under their joined name, "Q4_K+Q6_K"), largest first."""
    held: dict[str, int] = {}
    for linear in _linears(model):
        fmt = linear.weight_format
        held[fmt.format] = held.get(fmt.format, 0) + fmt.nbytes
    return dict(sorted(held.items(), key=lambda item: -item[1]))


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: each linear's weight in its format, the
    other parameters (norms, biases, float tables), and the embedding's and LM head's
    quantized or packed tables."""
    linears = _linears(model)
    linear_weights = {id(linear.weight) for linear in linears}
    params = {id(p): p for p in model.parameters() if id(p) not in linear_weights}
    total = sum(p.numel() * p.element_size() for p in params.values())
    total += sum(linear.weight_format.nbytes for linear in linears)
    seen: set[int] = set()
    for table in (m for m in model.modules() if isinstance(m, VocabEmbedding)):
        if table.quantized is not None and id(table.quantized) not in seen:
            seen.add(id(table.quantized))
            total += table.quantized.nbytes
        if not isinstance(table, LMHead):
            continue
        if table.native is not None:
            total += int(table.native.weight_bytes())
        packed = table.packed  # oneDNN's copy (PackedWeight)
        if packed is not None:
            total += packed.tensor.numel() * packed.tensor.element_size()
    for module in model.modules():  # other modules' packed weights (the vision linears')
        packed = getattr(module, "packed", None)
        if isinstance(packed, PackedWeight) and not isinstance(module, LMHead):
            total += packed.tensor.numel() * packed.tensor.element_size()
    return total
