"""The projectors from a vision tower's rows to the text model's embeddings: LLaVA's MLP
(linear, activation, linear) and Idefics3's connector (pixel shuffle, one bias-free
linear)."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.layers.activation import activation
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
