"""A mixture of gated experts: each token's top k of E gated MLPs, weighted by the router.

`route` keeps each token's top k of the router's softmax (float32), renormalised to sum to
one where the family does (`norm_topk_prob`). Token slots are grouped by expert, so each
expert runs once per step over exactly its rows, and the weighted outputs add back per
token in float32; Qwen2-MoE adds a shared expert behind a sigmoid gate. On CUDA the stacked
experts run through pagestream_kernels/triton/fused_moe.py's grouped GEMMs (`use_triton`).

Under tensor parallelism each expert splits over its intermediate features like the dense
MLP, or with `expert_parallel` each rank holds a contiguous block of whole experts (the
shared expert still split); either way the ranks' partial sums meet in one all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from services.worker.layers.gated_mlp import GatedMLP
from services.worker.layers.linear_weight import FloatWeight
from services.worker.parallel_state import tp_all_reduce

if TYPE_CHECKING:
    from services.worker.models.decoder_spec import LayerSpec


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top k experts and their weights: router_logits [T, E] ->
    (weights [T, k] float32, experts [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def group_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The token slots ordered by expert: experts [T, k] -> (slots [T * k], the count of
    slots per expert [E]); slot s is token s // k's (s % k)-th pick."""
    slots = torch.argsort(experts.reshape(-1), stable=True)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    return slots, counts.tolist()


def expert_range(num_experts: int, tp_rank: int, tp_size: int) -> range:
    """The experts one rank holds under expert parallelism (a contiguous block)."""
    if num_experts % tp_size:
        raise ValueError(
            f"--enable-expert-parallel needs --tensor-parallel-size {tp_size} to divide the "
            f"model's {num_experts} experts."
        )
    share = num_experts // tp_size
    return range(tp_rank * share, (tp_rank + 1) * share)


class FusedMoE(nn.Module):
    """The mixture of a layer described by `spec` (LayerSpec with mlp == "moe")."""

    def __init__(
        self,
        spec: LayerSpec,
        hidden_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = spec.experts_per_token, spec.renormalize
        self.tp_size = tp_size
        num_experts = self.num_experts = spec.num_experts
        # the router stays replicated and unquantized (a plain parameter, not a LinearBase)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        whole = expert_parallel and tp_size > 1
        self.local_experts = (
            expert_range(num_experts, tp_rank, tp_size) if whole else range(num_experts)
        )
        # an expert's own split: whole on its rank under expert parallelism, else 1 / tp
        split = (0, 1) if whole else (tp_rank, tp_size)
        inter, act = spec.intermediate_size, spec.activation
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, inter, act, False, *split, reduce_results=False)
            if j in self.local_experts
            else nn.Identity()
            for j in range(num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        if spec.shared_expert_size:
            self.shared_expert = GatedMLP(
                hidden_size, spec.shared_expert_size, act, False, tp_rank, tp_size, False
            )
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        # (w13 [E, 2I, H], w2 [E, H, I], local index of each expert or -1): use_triton's
        self.triton: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def use_triton(self) -> bool:
        """Runs the experts through the Triton kernels (pagestream_kernels/triton/fused_moe.py)
        where every local expert holds a float weight: their weights stacked once ([E, 2I,
        H] and [E, H, I]), each expert's parameters then views of the stacks (held once).
        False, and the loop over experts stays, for other formats."""
        local = [self.experts[j] for j in self.local_experts]
        linears = [lin for e in local for lin in (e.gate_up_proj, e.down_proj)]
        if not all(isinstance(lin.weight_format, FloatWeight) for lin in linears):
            return False
        w13 = torch.stack([e.gate_up_proj.weight.detach() for e in local])
        w2 = torch.stack([e.down_proj.weight.detach() for e in local])
        for i, expert in enumerate(local):
            expert.gate_up_proj.weight.data = w13[i]
            expert.down_proj.weight.data = w2[i]
        index = torch.full((self.num_experts,), -1, dtype=torch.int64, device=w13.device)
        index[self.local_experts.start : self.local_experts.stop] = torch.arange(
            len(local), device=w13.device
        )
        self.triton = (w13, w2, index)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] in x's dtype; the experts' sum accumulated in float32."""
        weights, experts = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        if self.triton is not None:
            from pagestream_kernels.triton.fused_moe import fused_moe

            w13, w2, index = self.triton
            out = fused_moe(x, w13, w2, weights, index[experts])
        else:
            out = self._experts_loop(x, weights, experts)
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight).float())  # [T, 1]
            out += gate * self.shared_expert(x).float()
        if self.tp_size > 1:
            tp_all_reduce(out)
        return out.to(x.dtype)

    def _experts_loop(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The local experts' weighted sum [T, H] float32, expert by expert in torch."""
        slots, counts = group_by_expert(experts, self.num_experts)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        start = 0
        for j, count in enumerate(counts):
            rows = slots[start : start + count]  # this expert's token slots
            start += count
            if count == 0 or j not in self.local_experts:
                continue
            tokens = rows // self.top_k
            y = self.experts[j](x[tokens])  # [count, H]
            out.index_add_(0, tokens, y.float() * weights.reshape(-1)[rows, None])
        return out
