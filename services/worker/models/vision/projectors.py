"""The projectors from a vision tower's rows to the text model's embeddings: LLaVA's MLP
(linear, activation, linear), Idefics3's connector (pixel shuffle, one bias-free linear)
and Gemma 3's (average pool, RMSNorm, one matrix)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.activation import activation
from services.worker.layers.layernorm import RMSNorm
from services.worker.models.vision.pixel_shuffle import pixel_shuffle


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, text_hidden, bias=bias)
        self.act = activation(act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., text_hidden]."""
        return self.linear_2(self.act(self.linear_1(x)))


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, scale_factor: int, text_hidden: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.proj = nn.Linear(vision_hidden * scale_factor**2, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, vision_hidden] -> [B, N / s^2, text_hidden]."""
        return self.proj(pixel_shuffle(x, self.scale_factor))


class Gemma3Projector(nn.Module):
    """Gemma 3's: the patch grid average-pooled to mm_tokens_per_image rows, Gemma's
    (1 + w) RMSNorm, then a [vision_hidden, text_hidden] matrix (held as HF holds it)."""

    def __init__(
        self, vision_hidden: int, patches_per_side: int, tokens: int, text_hidden: int, eps: float
    ) -> None:
        super().__init__()
        side = round(tokens**0.5)
        if side * side != tokens or patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {tokens} is not a square whose side divides the "
                f"tower's {patches_per_side} patches per side."
            )
        self.patches_per_side, self.kernel = patches_per_side, patches_per_side // side
        self.mm_soft_emb_norm = RMSNorm(vision_hidden, eps, unit_offset=True)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision_hidden, text_hidden), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, vision_hidden] (N = patches_per_side^2) -> [B, tokens, text_hidden]."""
        batch, _, hidden = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(batch, hidden, side, side)  # [B, hidden, side, side]
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel)  # [B, hidden, s, s]
        rows = pooled.flatten(2).transpose(1, 2)  # [B, tokens, hidden]
        return (self.mm_soft_emb_norm(rows) @ self.mm_input_projection_weight).to(x.dtype)
