"""Linear layers with weight-loader hooks, ready to be sharded for tensor parallelism.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id)`. Column layers
split their output features across `tp_size` ranks, the row layer its input features
(all-reducing its output); fused layers (QKV, gate/up) take the separate HF tensors by
`shard_id`. A checkpoint tensor may be quantized (a GGUF file's MappedBlocks, or int8 /
int4 quantized online): the same narrowing applies, and the layer's WeightBuilder keeps
the shards until the final form is made, once (`prepare_for_torch` or `to_native`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.layers.linear_weight import FloatWeight, LinearWeight, copy_checked
from services.worker.layers.quantization.loading import (
    Checkpoint,
    OnlineQuantization,
    narrow,
    split_rows,
)
from services.worker.layers.weight_builder import WeightBuilder
from services.worker.parallel_state import tp_all_reduce

if TYPE_CHECKING:
    from services.worker.lora.lora_slots import LinearLoRA


def _new_param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: every weight comes from the checkpoint (loads stay fast).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _check_divisible(name: str, size: int, tp_size: int) -> None:
    if size % tp_size != 0:
        raise ValueError(f"{name} ({size}) must be divisible by tp_size ({tp_size}).")


class LinearBase(nn.Module):
    """y = x W^T (+ b); weight is [output_size, input_size] as in the checkpoint.

    `weight_format` (linear_weight.py) is what forward runs: the float parameter as it
    loads, then the final form, set once by `prepare_for_torch` or `to_native` from what
    `builder` collected (None after)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.weight = _new_param(output_size, input_size)
        self.weight.weight_loader = self._load_weight
        if bias:
            self.bias = _new_param(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.weight_format: LinearWeight = FloatWeight(self.weight)
        self.builder: WeightBuilder | None = WeightBuilder(self.weight)
        self.lora: LinearLoRA | None = None  # adapters' adds (services/worker/lora)

    @property
    def format(self) -> str:
        """The format the weight is held in ("Q4_K+Q6_K", "bfloat16"), finished or not."""
        return self.builder.format if self.builder is not None else self.weight_format.format

    def quantize_online(self, online: OnlineQuantization) -> None:
        """Float checkpoint tensors are quantized as they load (int8 / int4)."""
        self._building().online = online

    def _building(self) -> WeightBuilder:
        if self.builder is None:
            raise ValueError("the layer's weight is finished: it takes no checkpoint tensors")
        return self.builder

    def _load_weight(
        self, param: nn.Parameter, loaded: Checkpoint, shard_id: object = None
    ) -> None:
        """The weight's loader: the builder sees the whole checkpoint tensor first (online
        quantization runs before tensor-parallel narrowing, so every shard has the
        single-rank model's scales)."""
        self.weight_loader(param, self._building().prepare(loaded), shard_id)

    def _store(self, param: nn.Parameter, src: Checkpoint, offset: int | None = None) -> None:
        """Stores `src` into `param` (rows from `offset` when given): the builder keeps a
        weight's shard; a bias is copied."""
        if param is self.weight:
            self._building().store(src, offset)
            return
        if not isinstance(src, torch.Tensor):
            raise ValueError("a quantized checkpoint tensor can only load into a weight")
        dst = param.data if offset is None else param.data.narrow(0, offset, src.shape[0])
        copy_checked(dst, src)

    def finish_loading(self) -> None:
        """After every checkpoint tensor is in: ValueError when quantized rows are missing
        or mixed with float ones (the final form is made later, in one step)."""
        if self.builder is not None:
            self.builder.check()

    def _loaded(self) -> LinearWeight:
        """The loaded weight, taken from the builder once (the finished form after)."""
        builder, self.builder = self.builder, None
        return builder.finish() if builder is not None else self.weight_format

    def prepare_for_torch(self, dtype: torch.dtype) -> None:
        """The form the torch modules run: de-quantized to `dtype`, oneDNN-packed on CPU."""
        self.weight_format = self._loaded().for_torch(dtype)

    def to_native(self, bias: torch.Tensor) -> object:
        """The C++ packed linear of this weight (pagestream_kernels/cpu/linear.h) with `bias`
        folded in; the layer's own copy is freed (the C++ object holds the weight)."""
        native, self.weight_format = self._loaded().for_native(bias)
        return native

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Checkpoint, shard_id: object = None
    ) -> None:
        self._store(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_format.apply(x, self.bias)
        if self.lora is not None:
            self.lora.add(x, out)
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"tp={self.tp_rank}/{self.tp_size}, {self.format}"
        )


class ColumnLinear(LinearBase):
    """Output features split across ranks; each rank keeps rows [rank*n, (rank+1)*n)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        _check_divisible("output_size", output_size, tp_size)
        super().__init__(input_size, output_size // tp_size, bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Checkpoint, shard_id: object = None
    ) -> None:
        size = self.output_size
        self._store(param, narrow(loaded_weight, 0, self.tp_rank * size, size))


class MergedColumnLinear(ColumnLinear):
    """Several column layers fused along the output (e.g. gate_proj and up_proj).

    shard_id is the index into `output_sizes` of the checkpoint tensor being loaded.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        for size in output_sizes:
            _check_divisible("each of output_sizes", size, tp_size)
        self.output_sizes = tuple(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        """(offset, size) of shard `shard_id` inside this rank's fused output."""
        sizes = [size // self.tp_size for size in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Checkpoint, shard_id: object = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            super().weight_loader(param, loaded_weight)
            return
        offset, size = self.shard_range(int(shard_id))  # type: ignore[call-overload]
        self._store(param, narrow(loaded_weight, 0, self.tp_rank * size, size), offset)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split across ranks, or one replicated head per rank when there are fewer
    KV heads than ranks (then tp_size must be a multiple of num_kv_heads)."""
    if num_kv_heads >= tp_size:
        _check_divisible("num_kv_heads", num_kv_heads, tp_size)
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must be divisible by or divide tp_size ({tp_size})."
        )
    return 1


class QKVLinear(LinearBase):
    """Fused query/key/value projection; shard_id is "q", "k" or "v".

    With tensor parallelism each rank holds num_heads/tp_size query heads and
    num_kv_heads/tp_size key/value heads; with fewer KV heads than ranks, rank r keeps
    KV head r // (tp_size / num_kv_heads) (replicated across those ranks).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        _check_divisible("num_heads", num_heads, tp_size)
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp_size)
        self.total_num_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def _kv_head_start(self) -> int:
        if self.total_num_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads
        return self.tp_rank // (self.tp_size // self.total_num_kv_heads)

    def _ranges(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in this rank's fused output, offset in the checkpoint tensor, size)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv_src = self._kv_head_start() * self.head_dim
        return {
            "q": (0, self.tp_rank * q_size, q_size),
            "k": (q_size, kv_src, kv_size),
            "v": (q_size + kv_size, kv_src, kv_size),
        }[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Checkpoint, shard_id: object = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor: cut it into q, k, v
            if self.tp_size == 1:
                self._store(param, loaded_weight)
                return
            q_total = self.num_heads * self.tp_size * self.head_dim
            kv_total = self.total_num_kv_heads * self.head_dim
            parts = split_rows(loaded_weight, [q_total, kv_total, kv_total])
            for name, part in zip("qkv", parts, strict=True):
                self.weight_loader(param, part, name)
            return
        dst, src, size = self._ranges(str(shard_id))
        self._store(param, narrow(loaded_weight, 0, src, size), dst)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[num_tokens, (H + 2*K) * D] -> q [num_tokens, H*D], k, v [num_tokens, K*D]."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return q, k, v


class RowLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed (all-reduce).

    The bias is added once, after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_results: bool = True,
    ) -> None:
        _check_divisible("input_size", input_size, tp_size)
        super().__init__(input_size // tp_size, output_size, bias, tp_rank, tp_size)
        self.reduce_results = reduce_results

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Checkpoint, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # bias: replicated
            copy_checked(param.data, loaded_weight)
            return
        size = self.input_size
        self._store(param, narrow(loaded_weight, 1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight_format.apply(x, None)
        if self.lora is not None:  # before the all-reduce, which sums it like the base
            self.lora.add(x, out)
        if self.tp_size > 1 and self.reduce_results:
            tp_all_reduce(out)
        if self.bias is not None and (self.tp_rank == 0 or self.reduce_results):
            out = out + self.bias
        return out
