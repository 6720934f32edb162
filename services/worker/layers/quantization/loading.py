"""Loading quantized weights into the layers: the parts of one layer's weight by row
offset (`WeightParts`), the online quantization of float checkpoint tensors (before
tensor-parallel narrowing, so every shard holds the single-rank model's rows and scales),
and the narrowing the weight loaders apply to any kind of checkpoint tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.worker.layers.quantization.mapped_blocks import (
    MappedBlocks,
    decoded,
    dequantized,
)
from services.worker.layers.quantization.online import quantize_int4, quantize_int8
from services.worker.layers.quantization.quantized_weight import QuantizedWeight, cat_rows

ONLINE_METHODS = ("int8", "int4")

Checkpoint = torch.Tensor | QuantizedWeight | MappedBlocks
Quantized = QuantizedWeight | MappedBlocks  # a quantized checkpoint tensor


def narrow(tensor: Checkpoint, dim: int, start: int, size: int) -> Checkpoint:
    """tensor.narrow(dim, start, size) for a float tensor or a quantized one (dim 0: output
    features, dim 1: input features)."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, size)
    return tensor.narrow_rows(start, size) if dim == 0 else tensor.narrow_cols(start, size)


def split_rows(tensor: Checkpoint, sizes: Sequence[int]) -> list[Checkpoint]:
    """tensor.split(sizes, dim=0) for either kind."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [narrow(tensor, 0, start, size) for start, size in zip(offsets, sizes, strict=True)]


def select_rows(tensor: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """Rows `index` (int64 [R]) of a QuantizedWeight (an embedding lookup, a permutation)."""
    mins = tensor.mins[index] if tensor.mins is not None else None
    return dataclasses.replace(
        tensor, codes=tensor.codes[index], scales=tensor.scales[index], mins=mins
    )


def pad_rows(tensor: Quantized, rows: int) -> Quantized:
    """`tensor` with zero rows appended up to `rows` (a vocabulary shard's padding; a
    padded one is decoded)."""
    extra = rows - tensor.shape[0]
    if extra <= 0:
        return tensor
    tensor = decoded(tensor)
    zeros = dataclasses.replace(
        tensor,
        codes=tensor.codes.new_zeros((extra, tensor.codes.shape[1])),
        scales=tensor.scales.new_zeros((extra, tensor.scales.shape[1])),
        mins=None if tensor.mins is None else tensor.mins.new_zeros((extra, tensor.mins.shape[1])),
    )
    return cat_rows([tensor, zeros])


def dequantize_into(module, dtype: torch.dtype) -> None:
    """`module.weight` back in float from `module.quantized` (which is then dropped)."""
    if module.quantized is not None:
        table = dequantized(module.quantized, dtype)
        module.weight.data = table.to(module.weight.device)
        module.quantized = None


@dataclass(frozen=True)
class OnlineQuantization:
    """Weight-only quantization of a float checkpoint at load: int8 (per output channel,
    symmetric) or int4 (groups of `group_size` with scales and zero points)."""

    method: str
    group_size: int = 128

    def __post_init__(self) -> None:
        if self.method not in ONLINE_METHODS:
            raise ValueError(f"online quantization is one of {ONLINE_METHODS}, not {self.method!r}")

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        """weight [N, K] float -> its QuantizedWeight."""
        if self.method == "int8":
            return quantize_int8(weight)
        if weight.shape[1] % self.group_size:
            raise ValueError(
                f"int4 groups of {self.group_size} do not divide the {weight.shape[1]} input "
                "features of a weight; pick --quantization-group-size 32 (or another divisor)"
            )
        return quantize_int4(weight, self.group_size)


class WeightParts:
    """The quantized shards of one layer's weight [rows, K] by row offset."""

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.parts: dict[int, Quantized] = {}

    def add(self, offset: int, part: Quantized) -> None:
        n, k = part.shape
        if k != self.cols or offset < 0 or offset + n > self.rows:
            raise ValueError(
                f"checkpoint tensor has shape {part.shape} at row {offset}, expected rows "
                f"within {self.rows} and {self.cols} input features"
            )
        self.parts[offset] = part

    def __bool__(self) -> bool:
        return bool(self.parts)

    def ordered(self) -> list[Quantized]:
        """The parts in row order; raises ValueError when they do not tile the rows."""
        ordered = sorted(self.parts.items())
        row = 0
        for offset, part in ordered:
            if offset != row:
                raise ValueError(f"quantized rows [{row}, {offset}) of the weight were not loaded")
            row += part.shape[0]
        if row != self.rows:
            raise ValueError(f"quantized rows [{row}, {self.rows}) of the weight were not loaded")
        return [part for _, part in ordered]
