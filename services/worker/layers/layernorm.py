"""RMSNorm, computed in float32 as HF transformers' LlamaRMSNorm.

The output takes the weight's dtype: with a float32 residual stream around bfloat16
weights (the CPU's mixed precision, see models/llama.py) the norm reads the float32
residual and hands the next matmul its bfloat16 input; with matching dtypes it is exactly
HF's computation."""

from __future__ import annotations

import torch
from torch import nn

from pagestream_kernels.cpu import fused_ops


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, the statistics in float32; output in out_dtype
    (default: the weight's dtype). On the CPU one fused C++ pass (pagestream_kernels/cpu/fused.cpp)
    where it applies, else the torch composition."""
    if out_dtype in (None, weight.dtype) and x.device.type == "cpu":
        fused = fused_ops.rms_norm(x, weight, eps)
        if fused is not None:
            return fused
    return rms_norm_torch(x, weight, eps, out_dtype)


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, rms_norm of it in the weight's dtype): a decoder layer's residual add
    and the next norm, fused on the CPU."""
    if residual.device.type == "cpu":
        fused = fused_ops.add_rms_norm(residual, x, weight, eps)
        if fused is not None:
            return fused
    total = residual + x
    return total, rms_norm_torch(total, weight, eps)


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """rms_norm as torch ops (any device); HF's LlamaRMSNorm with matching dtypes."""
    out_dtype = out_dtype or weight.dtype
    x32 = x.to(torch.float32)  # [num_tokens, hidden_size]
    variance = x32.pow(2).mean(-1, keepdim=True)  # [num_tokens, 1]
    normed = x32 * torch.rsqrt(variance + eps)
    return weight.to(out_dtype) * normed.to(out_dtype)


class RMSNorm(nn.Module):
    """`unit_offset`: Gemma's norm, x / rms(x) * (1 + w) with the product in float32 (HF's
    Gemma3RMSNorm): the weight is held in float32 with the 1 added at load, so the same
    norm kernels (and the native step) run it as a plain RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        dtype = torch.float32 if unit_offset else None
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset
        if unit_offset:
            self.weight.weight_loader = _load_plus_one

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.unit_offset:  # the product in float32, then rounded once
            return rms_norm(x, self.weight, self.eps).to(out_dtype or x.dtype)
        return rms_norm(x, self.weight, self.eps, out_dtype)

    def add_and_norm(
        self, residual: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, this norm of it)."""
        return add_rms_norm(residual, x, self.weight, self.eps)

    def extra_repr(self) -> str:
        offset = ", unit_offset" if self.unit_offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"


def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    """A (1 + w) norm's checkpoint weight w, held as 1 + w in float32."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded.to(torch.float32) + 1.0)
