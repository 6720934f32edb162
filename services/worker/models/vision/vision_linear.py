"""VisionLinear: a vision tower's nn.Linear (HF's `weight` / `bias` names, loaded by name)
whose CPU forward runs the project's float linear (services/worker/layers/matmul.py) over
the rows: oneDNN on a weight packed once into its blocked layout (`pack`, after loading),
in the model's dtype (float32 stays float32; bfloat16 runs oneDNN's bf16 kernels, AMX where
the CPU has it, with float32 accumulation). Results equal F.linear's to the dtype's rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.matmul import linear
from services.worker.layers.packed_weight import PackedWeight


class VisionLinear(nn.Linear):
    packed: PackedWeight | None = None

    def pack(self) -> None:
        """The weight in oneDNN's layout (where this torch and device have one); the plain
        copy is freed then, as the text model's linears do (the packed one serves every
        input in the model's dtype)."""
        if self.packed is not None:
            return
        self.packed = PackedWeight.of(self.weight)
        if self.packed is not None:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out], then GELU when `gelu` names its approximation ("none"
        or "tanh", as F.gelu): inside oneDNN's kernel once packed."""
        rows = x.reshape(-1, x.shape[-1])  # [tokens, in]
        if self.packed is None:
            out = linear(rows, self.weight, self.bias)  # [tokens, out]
            out = out if gelu is None else F.gelu(out, approximate=gelu)
        elif self.packed.applies(rows):
            out = self.packed(rows, self.bias, gelu)
        else:
            raise ValueError(
                f"the vision linear is packed for {self.packed.tensor.dtype} rows, not {x.dtype}."
            )
        return out.view(*x.shape[:-1], out.shape[-1])


def fused(parts: list[nn.Linear]) -> VisionLinear:
    """One VisionLinear whose output is the parts' outputs side by side (q | k | v): their
    weights stacked along the output features, their biases likewise (all or none)."""
    weight = torch.cat([p.weight.detach() for p in parts])  # [sum(out), in]
    has_bias = parts[0].bias is not None
    if any((p.bias is not None) != has_bias for p in parts):
        raise ValueError("fused linears must all have a bias or all have none")
    out = VisionLinear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return out
