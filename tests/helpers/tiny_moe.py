"""A tiny mixture-of-experts layer's spec (6 experts, the top 2) and random weights for it."""

from __future__ import annotations

import torch

from services.worker.models.decoder_spec import LayerSpec

HIDDEN = 32


def moe_spec(shared: int = 0, renormalize: bool = True) -> LayerSpec:
    return LayerSpec(
        index=0,
        num_heads=2,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=24,
        activation="silu",
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        sliding_window=None,
        mlp="moe",
        num_experts=6,
        experts_per_token=2,
        renormalize=renormalize,
        shared_expert_size=shared,
    )


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return module
