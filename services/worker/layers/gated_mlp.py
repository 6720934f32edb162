"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one projection.

    mlp = GatedMLP(hidden_size=576, intermediate_size=1536, activation="silu")
    y = mlp(x)  # [num_tokens, hidden_size] -> [num_tokens, hidden_size]

Dense decoder layers hold one; a mixture of experts holds one per expert (and its shared
expert), whose partial sums under tensor parallelism are added before one all-reduce
(`reduce_results=False`).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.activation import GatedActivation
from services.worker.layers.linear import MergedColumnLinear, RowLinear


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        inter = intermediate_size
        self.gate_up_proj = MergedColumnLinear(hidden_size, [inter, inter], bias, tp_rank, tp_size)
        self.down_proj = RowLinear(inter, hidden_size, bias, tp_rank, tp_size, reduce_results)
        self.act_fn = GatedActivation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, H] -> [T, H]
