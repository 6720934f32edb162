"""A linear layer's weight as one object per format (vLLM's `quant_method` idea).

Every linear (services/worker/layers/linear.py) holds one `LinearWeight` and calls it; the
format is the object's class, never a set of optional attributes:

    FloatWeight          the checkpoint's float tensor in the layer's parameter
    OneDNNWeight         the float weight reordered once into oneDNN's blocked layout (CPU)
    QuantizedParts       quantized checkpoint shards arriving (GGUF blocks, or float
                         tensors quantized online: int8 / int4), by row offset
    QuantizedLinearWeight  the whole quantized weight (a QuantizedWeight)
    NativeWeight         handed to the C++ GEMM (pagestream_kernels/cpu/linear.h): the C++ object
                         holds it; torch holds nothing

One small interface: `store` (a checkpoint shard into its rows), `finish` (after every
tensor is in: the loaded form), `for_native` (the C++ packed linear, and what the layer
holds after), `for_torch` (what the torch modules run: de-quantized, oneDNN-packed),
`apply` (y = x W^T + b), `nbytes` and `format`. Each transition returns the next object
and the layer keeps it, so the order of a load is the objects' own: store* -> finish ->
for_native | for_torch.
"""

from __future__ import annotations

import torch
from torch import nn

from pagestream_kernels import cpu
from services.worker.layers.matmul import linear
from services.worker.layers.packed_weight import PackedWeight
from services.worker.layers.quantization import QuantizedWeight
from services.worker.layers.quantization.loading import Checkpoint, OnlineQuantization, WeightParts
from services.worker.layers.quantization.quantized_weight import joined_sources


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_quantized(q: QuantizedWeight, bias: torch.Tensor, bf16_rows: bool) -> object:
    """`q` packed for the C++ GEMM (pagestream_kernels/cpu/quantized_linear.cpp) with `bias` (empty:
    none); `bf16_rows`: a bfloat16 model's many-row products may run in bfloat16."""
    mins = q.mins if q.mins is not None else torch.empty(0)
    return cpu.load().PackedLinear.quantized(
        q.bits, q.codes, q.scales, mins, q.group_size, bias, q.source, bf16_rows
    )


class LinearWeight:
    """The interface (see the module docstring); `param` is the layer's weight parameter,
    which keeps the model's dtype and device even when it holds no elements."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param

    @property
    def format(self) -> str:
        return _dtype_name(self.param.dtype)

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    def prepare(self, src: Checkpoint) -> Checkpoint:
        """A whole checkpoint tensor before the layer narrows it to its shard."""
        return src

    def store(self, src: Checkpoint, offset: int | None) -> LinearWeight:
        raise ValueError(f"a {type(self).__name__} takes no checkpoint tensors")

    def finish(self) -> LinearWeight:
        return self

    def for_torch(self, dtype: torch.dtype) -> LinearWeight:
        return self

    def for_native(self, bias: torch.Tensor) -> tuple[object, LinearWeight]:
        raise ValueError(f"a {type(self).__name__} has no native form")

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise ValueError(f"a {type(self).__name__} cannot be applied")

    def _release(self) -> None:
        self.param.data = self.param.data.new_empty(0)


class FloatWeight(LinearWeight):
    """The float tensor in `param` (filled shard by shard)."""

    def store(self, src: Checkpoint, offset: int | None) -> LinearWeight:
        if isinstance(src, QuantizedWeight):  # the first quantized shard: parts from now on
            parts = QuantizedParts(self.param, None)
            return parts.store(src, offset)
        dst = self.param.data if offset is None else self.param.data.narrow(0, offset, len(src))
        copy_checked(dst, src)
        return self

    def for_torch(self, dtype: torch.dtype) -> LinearWeight:
        packed = PackedWeight.of(self.param)
        return self if packed is None else OneDNNWeight(self.param, packed)

    def for_native(self, bias: torch.Tensor) -> tuple[object, LinearWeight]:
        native = cpu.load().PackedLinear(self.param.detach(), bias)
        self._release()
        return native, NativeWeight(self.param, native)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.param, bias)


class OneDNNWeight(LinearWeight):
    """The float weight in oneDNN's layout (packed_weight.py); the plain copy is freed (the
    packed one serves every input)."""

    def __init__(self, param: nn.Parameter, packed: PackedWeight) -> None:
        super().__init__(param)
        self.packed = packed
        self._release()

    @property
    def nbytes(self) -> int:
        tensor = self.packed.tensor
        return super().nbytes + tensor.numel() * tensor.element_size()

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, self.param, bias, self.packed)


class QuantizedParts(LinearWeight):
    """Quantized shards by row offset; `online` quantizes float tensors first."""

    def __init__(self, param: nn.Parameter, online: OnlineQuantization | None) -> None:
        super().__init__(param)
        self.online = online
        self.parts = WeightParts(param.shape[0], param.shape[1])

    @property
    def format(self) -> str:
        return "loading"

    def prepare(self, src: Checkpoint) -> Checkpoint:
        """Online quantization of a float tensor, before it is narrowed (so every
        tensor-parallel shard has the single-rank model's scales)."""
        if self.online is not None and isinstance(src, torch.Tensor):
            return self.online.quantize(src)
        return src

    def store(self, src: Checkpoint, offset: int | None) -> LinearWeight:
        if isinstance(src, torch.Tensor):
            raise ValueError("a float checkpoint tensor cannot join a quantized weight")
        self.parts.add(offset or 0, src)
        return self

    def finish(self) -> LinearWeight:
        """The whole weight (ValueError when rows are missing); the float parameter, never
        filled, is freed."""
        if not self.parts:  # online quantization set, but no tensor arrived
            return FloatWeight(self.param)
        weight = QuantizedLinearWeight(self.param, self.parts.ordered())
        self._release()
        return weight


class QuantizedLinearWeight(LinearWeight):
    """A whole quantized weight as its row parts in order (a fused layer's q / k / v or
    gate / up, each in the format it came in): the C++ GEMM runs each part as it is, into
    its own output columns, so no part is widened to another's format and nothing is
    copied to join them; the torch modules take the weight de-quantized once (they have no
    quantized kernel)."""

    def __init__(self, param: nn.Parameter, parts: list[QuantizedWeight]) -> None:
        super().__init__(param)
        self.parts = parts

    @property
    def format(self) -> str:
        return joined_sources(self.parts)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def for_torch(self, dtype: torch.dtype) -> LinearWeight:
        rows = [part.dequantize(dtype) for part in self.parts]
        self.param.data = torch.cat(rows).to(self.param.device)
        return FloatWeight(self.param).for_torch(dtype)

    def for_native(self, bias: torch.Tensor) -> tuple[object, LinearWeight]:
        bf16_rows = self.param.dtype == torch.bfloat16
        natives, row = [], 0
        for q in self.parts:
            n = q.shape[0]
            natives.append(
                pack_quantized(q, bias[row : row + n] if bias.numel() else bias, bf16_rows)
            )
            row += n
        native = natives[0] if len(natives) == 1 else cpu.load().PackedLinear.stacked(natives)
        return native, NativeWeight(self.param, native)


class NativeWeight(LinearWeight):
    """Held by the C++ packed linear `native` (which includes the bias it was given)."""

    def __init__(self, param: nn.Parameter, native: object) -> None:
        super().__init__(param)
        self.native = native

    @property
    def format(self) -> str:
        return str(self.native.format())

    @property
    def nbytes(self) -> int:
        return int(self.native.weight_bytes())

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.native.forward(x, torch.empty(0), 0)
