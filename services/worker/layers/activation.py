"""Gated activations over a fused [gate | up] projection (SwiGLU and friends)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from kernels.cpu import fused_ops


class GatedActivation(nn.Module):
    """act(gate) * up, where the input is the fused [..., 2 * d] = [gate | up] projection."""

    def __init__(self, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {hidden_act!r} is not a known activation.")
        self.hidden_act = hidden_act
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "silu" and gate_up.device.type == "cpu":
            fused = fused_ops.silu_and_mul(gate_up)  # one C++ pass (kernels/cpu/fused.cpp)
            if fused is not None:
                return fused
        gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, d] each
        return self.act_fn(gate) * up

    def extra_repr(self) -> str:
        return self.hidden_act
