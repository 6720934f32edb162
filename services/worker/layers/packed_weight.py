"""Linear weights reordered once, at load, into oneDNN's blocked layout (CPU).

oneDNN's linear reorders a plain [out, in] weight on every call; `_reorder_linear_weight`
does it once and `_linear_pointwise` takes the packed tensor from then on (as torch.compile's
CPU inductor does for frozen linears). `PackedWeight.of(weight)` packs a CPU float32 or
bfloat16 weight where this torch has oneDNN, else is None; the packed copy serves every
input, so the plain one is freed (linear_weight.OneDNNWeight; the LM head keeps both).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


def _ops():
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if reorder is None or linear is None or not torch.backends.mkldnn.is_available():
        return None
    return reorder, linear


_OPS = _ops()


def packing_enabled() -> bool:
    return _OPS is not None


PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in oneDNN's layout."""

    tensor: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedWeight | None:
        if not packing_enabled() or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if weight.dtype not in PACKED_DTYPES:
            return None
        reorder, _ = _OPS  # type: ignore[misc]
        return cls(reorder(weight.detach().contiguous()))

    def applies(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype == self.tensor.dtype

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, gelu: str | None = None
    ) -> torch.Tensor:
        """x [rows, in] -> [rows, out] (+ bias), then GELU when `gelu` names its
        approximation ("none" or "tanh", as F.gelu), applied inside oneDNN's kernel."""
        if x.shape[0] == 0:
            return x.new_empty((0, self.tensor.shape[0]))
        _, linear = _OPS  # type: ignore[misc]
        if gelu is None:
            return linear(x.contiguous(), self.tensor, bias, "none", [], "")
        return linear(x.contiguous(), self.tensor, bias, "gelu", [], gelu)
