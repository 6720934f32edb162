"""RMSNorm, computed in float32 as HF transformers' LlamaRMSNorm.

The output takes the weight's dtype: with a float32 residual stream around bfloat16
weights (the CPU's mixed precision, see models/llama.py) the norm reads the float32
residual and hands the next matmul its bfloat16 input; with matching dtypes it is exactly
HF's computation."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, the statistics in float32; output in out_dtype
    (default: the weight's dtype)."""
    out_dtype = out_dtype or weight.dtype
    x32 = x.to(torch.float32)  # [num_tokens, hidden_size]
    variance = x32.pow(2).mean(-1, keepdim=True)  # [num_tokens, 1]
    normed = x32 * torch.rsqrt(variance + eps)
    return weight.to(out_dtype) * normed.to(out_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, out_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
