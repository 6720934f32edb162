"""Pixel shuffle (Idefics3's connector): each s x s square of neighbouring patches becomes
one row of s^2 times the features, so an image costs s^2 fewer text positions."""

from __future__ import annotations

import torch


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """x [B, N, D] (a square grid of N patches, row-major) -> [B, N / s^2, D * s^2].

    Output row (p, q) of the (h/s) x (w/s) grid holds, in order, for each row offset b
    and then each column offset a of its square, patch (p*s + b, q*s + a)'s D features."""
    batch, num_patches, dim = x.shape
    side = round(num_patches**0.5)
    if side * side != num_patches or side % scale:
        raise ValueError(
            f"pixel shuffle by {scale} needs a square grid of patches whose side it divides; "
            f"got {num_patches} patches."
        )
    grid = side // scale
    x = x.reshape(batch, grid, scale, grid, scale, dim)  # [B, p, b, q, a, D]
    x = x.permute(0, 1, 3, 2, 4, 5)  # [B, p, q, b, a, D]
    return x.reshape(batch, grid * grid, scale * scale * dim)
