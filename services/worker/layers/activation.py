"""Gated activations over a fused [gate | up] projection (SwiGLU and friends)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagestream_kernels.cpu import fused_ops

# HF `hidden_act` names -> torch functions, as transformers' ACT2FN defines them (the names
# the native families use; any other name is looked up in ACT2FN itself, whose import costs
# ~1 s on 2 cores, so it is imported only then).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation HF calls `name`; ValueError for a name transformers does not know."""
    if name in _ACTIVATIONS:
        return _ACTIVATIONS[name]
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"hidden_act {name!r} is not a known activation.")
    return ACT2FN[name]


class GatedActivation(nn.Module):
    """act(gate) * up, where the input is the fused [..., 2 * d] = [gate | up] projection."""

    def __init__(self, hidden_act: str = "silu") -> None:
        super().__init__()
        self.hidden_act = hidden_act
        self.act_fn = activation(hidden_act)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.hidden_act == "silu" and gate_up.device.type == "cpu":
            fused = fused_ops.silu_and_mul(gate_up)  # one C++ pass (cpu/fused.cpp)
            if fused is not None:
                return fused
        gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, d] each
        return self.act_fn(gate) * up

    def extra_repr(self) -> str:
        return self.hidden_act
