"""RMSNorm, computed in float32 exactly as HF transformers' LlamaRMSNorm."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, the statistics in float32; output in x's dtype."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)  # [num_tokens, hidden_size]
    variance = x32.pow(2).mean(-1, keepdim=True)  # [num_tokens, 1]
    normed = x32 * torch.rsqrt(variance + eps)
    return weight * normed.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
