"""Token embedding and LM head, vocab-parallel, with weight-loader hooks like the linears.

Each rank holds ceil(vocab_size / tp_size) rows of the table (the last shard zero-padded):
the embedding looks up its range and all-reduces, the LM head gathers its logits' slices to
TP rank 0. A quantized table (a GGUF file's, or the head quantized online) stays quantized:
the head multiplies it through the C++ GEMM and the embedding de-quantizes only the rows it
looks up (from the head's packed copy when tied); a file's blocks are decoded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagestream_kernels import cpu
from services.worker.layers.linear_weight import pack_quantized
from services.worker.layers.matmul import linear
from services.worker.layers.packed_weight import PackedWeight
from services.worker.layers.quantization.loading import (
    Checkpoint,
    OnlineQuantization,
    Quantized,
    dequantize_into,
    pad_rows,
    select_rows,
)
from services.worker.layers.quantization.mapped_blocks import decoded, dequantized
from services.worker.parallel_state import tp_all_reduce, tp_gather_last_dim


class VocabEmbedding(nn.Module):
    """input_ids [num_tokens] -> [num_tokens, hidden_size]."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.shard_size = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.quantized: Quantized | None = None  # a quantized table, kept quantized
        self.row_source: object | None = None  # a packed tied head whose rows are looked up

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Checkpoint, shard_id: object = None
    ) -> None:
        expected = (self.vocab_size, self.hidden_size)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {expected}"
            )
        rows = self.vocab_end - self.vocab_start
        if not isinstance(loaded_weight, torch.Tensor):  # kept as it came until finished
            shard = loaded_weight.narrow_rows(self.vocab_start, rows)
            self.quantized = pad_rows(shard, self.shard_size)
            param.data = param.data.new_empty(0)  # never filled: the table stays quantized
            return
        param.data[:rows].copy_(loaded_weight.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def finish_loading(self) -> None:
        """A quantized table decoded for the lookups (an LM head tied to this embedding
        packs or de-quantizes the file's blocks itself: see model_weights)."""
        if self.quantized is not None:
            self.quantized = decoded(self.quantized)

    def dequantize_weight(self, dtype: torch.dtype) -> None:
        """The float table back from `quantized` (paths without a quantized kernel)."""
        dequantize_into(self, dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of this rank's table [len(ids), hidden_size]."""
        if self.row_source is not None:
            return self.row_source.gather_rows(ids)  # float32, from the packed head
        if self.quantized is not None:
            return select_rows(self.quantized, ids).dequantize()  # float32
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [num_tokens]
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = self._lookup(local)  # [num_tokens, hidden_size]
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return tp_all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}), tp={self.tp_rank}/{self.tp_size}"
        )


class LMHead(VocabEmbedding):
    """hidden [num_rows, hidden_size] -> logits [num_rows, vocab_size] float32 on TP rank 0
    (None on the other TP ranks). `tie_to(embedding)` shares the embedding's weight."""

    packed: PackedWeight | None = None
    native: object | None = (
        None  # pagestream_kernels/cpu PackedLinear: float32 logits around any weight
    )
    native_rescores = False  # the packed copy holds the float weight (not quantized codes)
    tied: VocabEmbedding | None = None
    online: OnlineQuantization | None = None  # quantize the float table at load

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        # a plain attribute, not a submodule (it would appear twice in the module tree)
        object.__setattr__(self, "tied", embedding)

    def dequantize_weight(self, dtype: torch.dtype) -> None:
        """The float table back from `quantized`; a tied embedding with a float table of its
        own (the head was quantized online) keeps it, and the head gets its own."""
        if self.quantized is None:
            return
        if self.tied is not None and self.tied.quantized is not self.quantized:
            table = dequantized(self.quantized, dtype).to(self.weight.device)
            self.weight = nn.Parameter(table, requires_grad=False)
            self.quantized = None
            return
        super().dequantize_weight(dtype)

    def finish_loading(self) -> None:
        """The head's quantized table: the tied embedding's, or its float one quantized
        online (a tied embedding keeps its float table for the lookups)."""
        if self.tied is not None and self.tied.quantized is not None:
            self.quantized = self.tied.quantized
        elif self.online is not None and self.quantized is None:
            self.quantized = self.online.quantize(self.weight.detach())
            if self.tied is None:
                self.weight.data = self.weight.data.new_empty(0)

    def pack(self) -> bool:
        """A oneDNN-layout copy of the (maybe tied) weight for the CPU matmul; the plain
        weight stays (the embedding lookup and `rescore_top` read its rows)."""
        self.packed = PackedWeight.of(self.weight)
        return self.packed is not None

    def pack_native(self) -> None:
        """The native CPU step's packed copy (cpu/linear.cpp), which accumulates and
        writes float32 logits; the plain weight stays for the lookup and the rescoring."""
        self.native = _packed_table(self)
        self.native_rescores = self.quantized is None
        tied = self.tied
        if self.quantized is not None and tied is not None and tied.quantized is self.quantized:
            # the tied embedding looks its rows up in the packed copy: the table is held once
            tied.row_source, tied.quantized = self.native, None
        self.quantized = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """float32 hidden states around bfloat16 weights (the CPU's mixed precision): the
        matmul runs in the weights' dtype, whose output rounding (up to ~0.25 on logits of
        this size) would flip near-ties, so the top RESCORED_CANDIDATES logits of every row
        are recomputed in float32 (an exact dot product each), which is what decides greedy
        tokens, as a float32 LM head on the same weights would."""
        low_precision = self.weight.dtype != torch.float32
        rescore = hidden_states.dtype == torch.float32 and low_precision and self.tp_size == 1
        if self.native is not None:  # float32 logits, the top ones rescored in the same call
            # a quantized head already computes float32 logits of its exact weights
            rescore = rescore and self.native_rescores
            exact = self.weight if rescore else torch.empty(0)
            logits = self.native.forward(hidden_states, exact, RESCORED_CANDIDATES)
        else:
            x = hidden_states.to(self.weight.dtype)
            logits = linear(x, self.weight, packed=self.packed)  # [num_rows, shard_size]
        if self.tp_size > 1:
            logits = tp_gather_last_dim(logits)  # [num_rows, tp * shard_size] on rank 0
            if logits is None:
                return None
        logits = logits[:, : self.vocab_size].float()
        if rescore and self.native is None:
            logits = rescore_top(logits, hidden_states, self.weight)
        return logits


RESCORED_CANDIDATES = 16


def _packed_table(table: VocabEmbedding) -> object:
    """An LM head's table packed for the C++ GEMM (pagestream_kernels/cpu/linear.h): its quantized
    table where it has one (services/worker/layers/quantization), else its float one."""
    if table.quantized is None:
        return cpu.load().PackedLinear(table.weight.detach(), torch.empty(0))
    return pack_quantized(table.quantized, torch.empty(0), table.weight.dtype == torch.bfloat16)


def rescore_top(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """logits [R, V] (from a low-precision matmul) with their top candidates recomputed as
    float32 dot products of hidden [R, H] (float32) and those rows of weight [V, H]."""
    k = min(RESCORED_CANDIDATES, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices  # [R, k]
    rows = weight[top].float()  # [R, k, H]
    exact = torch.einsum("rh,rkh->rk", hidden, rows)  # [R, k]
    return logits.scatter_(1, top, exact)
