"""The torch modules' fused CPU row ops (cpu/fused.cpp over the row kernels), or None where
they do not apply.

Each function returns the result, or None when the tensors are not what the C++ takes
(another device or dtype, a non-contiguous view, a weight dtype other than the output's)
or the extension cannot be built here; the caller then runs its torch composition, which
gives the same values (see row_kernels.h for the rounding points).
"""

from __future__ import annotations

import torch

from pagestream_kernels import cpu

_TYPES = (torch.float32, torch.bfloat16)


def _module():
    if "error" in cpu._state:  # tried before and failed: no retry per call
        return None
    try:
        return cpu.load()
    except RuntimeError:
        return None


def _fits(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype in _TYPES and t.is_contiguous() for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """[rows, h] -> rms_norm(x) * weight in the weight's dtype (HF's LlamaRMSNorm)."""
    if not _fits(x, weight) or (module := _module()) is None:
        return None
    out = torch.empty(x.shape, dtype=weight.dtype)
    none = torch.empty(0)
    module.add_rms_norm(out, none, none, x, weight, eps)
    return out


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(residual + x in the residual's dtype, its rms_norm in the weight's dtype)."""
    if not _fits(residual, x, weight) or (module := _module()) is None:
        return None
    if residual.shape != x.shape or residual.dtype != torch.promote_types(residual.dtype, x.dtype):
        return None
    total = torch.empty_like(residual)
    out = torch.empty(x.shape, dtype=weight.dtype)
    module.add_rms_norm(out, total, residual, x, weight, eps)
    return total, out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """[rows, 2d] = [gate | up] -> silu(gate) * up [rows, d]."""
    if not _fits(gate_up) or gate_up.shape[-1] % 2 or (module := _module()) is None:
        return None
    out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype)
    module.silu_and_mul(out, gate_up)
    return out


def rotary(
    heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor | None:
    """heads [T, N * head_dim] (rows may be strided, e.g. a slice of the QKV output) with
    cos/sin [T, 1, rotary_dim] float32 -> rotated, contiguous [T, N * head_dim]."""
    if (
        heads.device.type != "cpu"
        or heads.dtype not in _TYPES
        or heads.dim() != 2
        or heads.stride(1) != 1
        or (module := _module()) is None
    ):
        return None
    out = torch.empty(heads.shape, dtype=heads.dtype)
    module.rotary(out, heads, cos.contiguous(), sin.contiguous(), head_dim)
    return out
