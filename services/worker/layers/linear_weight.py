"""A linear layer's weight as one object per format (vLLM's `quant_method` idea):

    FloatWeight            the float weight in the layer's parameter (as loaded)
    OneDNNWeight           the float weight in oneDNN's blocked layout (the torch path, CPU)
    QuantizedLinearWeight  quantized row parts, each in its file's format (loaded)
    NativeWeight           held by the C++ GEMM (pagestream_kernels/cpu/linear.h)
A layer's WeightBuilder (weight_builder.py) `finish`es into FloatWeight or
QuantizedLinearWeight, which `for_torch` / `for_native` turn into the final form at once.
"""

from __future__ import annotations

import torch
from torch import nn

from pagestream_kernels import cpu
from services.worker.cpu_tuning import return_freed_memory
from services.worker.layers.matmul import linear
from services.worker.layers.packed_weight import PackedWeight
from services.worker.layers.quantization import QuantizedWeight
from services.worker.layers.quantization.mapped_blocks import (
    MappedBlocks,
    decoded,
    dequantized,
    row_chunks,
)
from services.worker.layers.quantization.quantized_weight import joined_sources


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_quantized(
    weight: QuantizedWeight | MappedBlocks, bias: torch.Tensor, bf16_rows: bool
) -> object:
    """`weight` packed for the C++ GEMM (pagestream_kernels/cpu/quantized_linear.cpp) with
    `bias` (empty: none); `bf16_rows`: a bfloat16 model's many-row products may run in
    bfloat16. A file's blocks are decoded into scratch, chunk by chunk (the C++ object
    holds its own layout), and the chunks stacked along the output features."""
    packed = []
    for start, rows in row_chunks(weight):
        part = weight if rows == weight.shape[0] else weight.narrow_rows(start, rows)
        part_bias = bias[start : start + rows] if bias.numel() else bias
        packed.append(_pack(decoded(part), part_bias, bf16_rows))
        # the scratch's pages back to the system before the next part: kept in glibc's
        # heap (cpu_tuning.tune_malloc), they would add up between the packed weights
        return_freed_memory()
    return packed[0] if len(packed) == 1 else cpu.load().PackedLinear.stacked(packed)


def _pack(q: QuantizedWeight, bias: torch.Tensor, bf16_rows: bool) -> object:
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
        return dtype_name(self.param.dtype)

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    def for_torch(self, dtype: torch.dtype) -> LinearWeight:
        return self

    def for_native(self, bias: torch.Tensor) -> tuple[object, LinearWeight]:
        raise ValueError(f"a {type(self).__name__} has no native form")

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise ValueError(f"a {type(self).__name__} cannot be applied")

    def _release(self) -> None:
        self.param.data = self.param.data.new_empty(0)


class FloatWeight(LinearWeight):
    """The float tensor in `param` (filled shard by shard while loading)."""

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


class QuantizedLinearWeight(LinearWeight):
    """A whole quantized weight as its row parts in order (a fused layer's q / k / v or
    gate / up, each in the format it came in): the C++ GEMM runs each part as it is, into
    its own output columns, so no part is widened to another's format and nothing is
    copied to join them; the torch modules take the weight de-quantized once (they have no
    quantized kernel)."""

    def __init__(self, param: nn.Parameter, parts: list[QuantizedWeight | MappedBlocks]) -> None:
        super().__init__(param)
        self.parts = parts  # a file's parts stay undecoded until the final form is made

    @property
    def format(self) -> str:
        return joined_sources(self.parts)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def for_torch(self, dtype: torch.dtype) -> LinearWeight:
        rows = [dequantized(part, dtype) for part in self.parts]
        self.param.data = torch.cat(rows).to(self.param.device)
        return FloatWeight(self.param).for_torch(dtype)

    def for_native(self, bias: torch.Tensor) -> tuple[object, LinearWeight]:
        bf16_rows = self.param.dtype == torch.bfloat16
        natives, row = [], 0
        for part in self.parts:  # one part decoded at a time: the scratch is one tensor's
            n = part.shape[0]
            natives.append(
                pack_quantized(part, bias[row : row + n] if bias.numel() else bias, bf16_rows)
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
