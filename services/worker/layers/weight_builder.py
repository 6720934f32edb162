"""`WeightBuilder`: a linear's checkpoint shards collected while it loads.

Float shards are copied into the layer's parameter at their rows; quantized ones (a GGUF
file's MappedBlocks, or float tensors quantized online: int8 / int4) are kept by row
offset as they came, undecoded. `finish()` is the loaded weight (linear_weight.py), which
the layer turns into its final form at once, part by part, so no whole-model
intermediate copy is ever held.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.linear_weight import (
    FloatWeight,
    LinearWeight,
    QuantizedLinearWeight,
    copy_checked,
    dtype_name,
)
from services.worker.layers.quantization.loading import Checkpoint, OnlineQuantization, WeightParts
from services.worker.layers.quantization.quantized_weight import joined_sources


class WeightBuilder:
    """The shards of the weight `param` [rows, K]; `online` quantizes float tensors first."""

    def __init__(self, param: nn.Parameter, online: OnlineQuantization | None = None) -> None:
        self.param = param
        self.online = online
        self.parts = WeightParts(param.shape[0], param.shape[1])

    @property
    def quantized(self) -> bool:
        """Whether quantized shards came (the float parameter is then never filled)."""
        return bool(self.parts)

    @property
    def format(self) -> str:
        """The formats of the shards so far ("Q4_K+Q6_K"), or the float dtype's name."""
        if self.quantized:
            return joined_sources([part for _, part in sorted(self.parts.parts.items())])
        return dtype_name(self.param.dtype)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts.parts.values())

    def prepare(self, src: Checkpoint) -> Checkpoint:
        """A whole checkpoint tensor before the layer narrows it: online quantization of a
        float one first, so every tensor-parallel shard has the single-rank model's scales."""
        if self.online is not None and isinstance(src, torch.Tensor):
            return self.online.quantize(src)
        return src

    def store(self, src: Checkpoint, offset: int | None) -> None:
        """`src` at rows from `offset` (0 when None)."""
        if not isinstance(src, torch.Tensor):
            self.parts.add(offset or 0, src)
            return
        if self.quantized:
            raise ValueError("a float checkpoint tensor cannot join a quantized weight")
        dst = self.param.data if offset is None else self.param.data.narrow(0, offset, len(src))
        copy_checked(dst, src)

    def check(self) -> None:
        """ValueError when quantized rows are missing; the never-filled float parameter of a
        quantized weight is freed."""
        if self.quantized:
            self.parts.ordered()
            self.param.data = self.param.data.new_empty(0)

    def finish(self) -> LinearWeight:
        """The loaded weight: the float parameter, or the quantized parts in row order."""
        if not self.quantized:
            return FloatWeight(self.param)
        self.check()
        return QuantizedLinearWeight(self.param, self.parts.ordered())
