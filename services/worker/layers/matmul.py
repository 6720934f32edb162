"""The float linear of the torch path on the CPU: y = x W^T (+ b), through oneDNN's packed
weight (made once at load: packed_weight.py), else oneDNN on the plain weight for float32
CPU inputs; any other device or dtype runs F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.layers.packed_weight import PackedWeight


def _onednn_linear_op():
    """oneDNN's linear (what torch.compile emits for CPU linears), where this torch has it."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    return op if op is not None and torch.backends.mkldnn.is_available() else None


_ONEDNN_LINEAR = _onednn_linear_op()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [num_tokens, in] and weight [out, in], faster on CPU.

    Without a packed copy, float32 CPU inputs run oneDNN's linear on the plain weight,
    faster than F.linear at every row count. Results equal F.linear's to float32 rounding.
    """
    if packed is not None and packed.applies(x):
        return packed(x, bias)
    rows = x.shape[0]
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or rows == 0:
        return F.linear(x, weight, bias)
    if _ONEDNN_LINEAR is None:
        return F.linear(x, weight, bias)
    return _ONEDNN_LINEAR(x.contiguous(), weight, bias, "none", [], "")
