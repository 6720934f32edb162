"""PatchEmbeddings: pixels -> one row per patch (a class token first for CLIP), plus each
patch's learned position embedding.

CLIP takes exactly its trained square (no interpolation of the position table here).
Idefics3 takes tiles of any size up to it: a patch mask [B, h, w] marks the patches that
hold pixels, and each real patch's position id is its fractional place in the tile
bucketed onto the trained grid (padding patches keep id 0).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.models.vision.vision_spec import VisionSpec


def bucketed_position_ids(patch_mask: torch.Tensor, patches_per_side: int) -> torch.Tensor:
    """patch_mask [B, h, w] bool -> position ids [B, h * w] int64: a real patch at row r of
    a tile n patches high (counted down its first column) sits at r / n of the height,
    bucketed into the trained grid's `patches_per_side` rows (the same for columns); the
    float steps are HF's exactly (a bucket boundary decides the id)."""
    batch, height, width = patch_mask.shape
    boundaries = torch.arange(1 / patches_per_side, 1.0, 1 / patches_per_side)
    rows = patch_mask[:, :, 0].sum(dim=1)  # [B] real patches down the tile
    cols = patch_mask[:, 0, :].sum(dim=1)  # [B] across
    frac_h = torch.arange(height, dtype=torch.float32)[None, :] * (1.0 / rows)[:, None]
    frac_w = torch.arange(width, dtype=torch.float32)[None, :] * (1.0 / cols)[:, None]
    bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)  # [B, h]
    bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)  # [B, w]
    ids = (bucket_h[:, :, None] * patches_per_side + bucket_w[:, None, :]).reshape(batch, -1)
    return torch.where(patch_mask.reshape(batch, -1), ids, torch.zeros_like(ids))


class PatchEmbeddings(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        size = spec.patch_size
        self.patch_embedding = nn.Conv2d(
            spec.num_channels, spec.hidden_size, size, stride=size, bias=spec.patch_bias
        )
        num_positions = spec.patches_per_side**2 + int(spec.class_token)
        self.position_embedding = nn.Embedding(num_positions, spec.hidden_size)
        if spec.class_token:
            self.class_embedding = nn.Parameter(torch.empty(spec.hidden_size))

    def forward(
        self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> [B, N, hidden] (N: the patches, plus the class
        token); patch_mask [B, H / p, W / p] bool (bucketed positions only)."""
        self._check_size(pixel_values)
        patches = self.patch_embedding(pixel_values)  # [B, hidden, H / p, W / p]
        # [B, h * w, hidden], contiguous: the residual stream keeps its input's layout
        # through every add, and each norm and linear would copy a transposed one
        rows = patches.flatten(2).transpose(1, 2).contiguous()
        if self.spec.bucketed_positions:
            if patch_mask is None:
                patch_mask = torch.ones(patches.shape[0], *patches.shape[2:], dtype=torch.bool)
            ids = bucketed_position_ids(patch_mask, self.spec.patches_per_side)
            return rows + self.position_embedding(ids.to(rows.device))
        if self.spec.class_token:
            cls = self.class_embedding.to(rows.dtype).expand(rows.shape[0], 1, -1)
            rows = torch.cat([cls, rows], dim=1)  # [B, 1 + h * w, hidden]
        return rows + self.position_embedding.weight[None]

    def _check_size(self, pixel_values: torch.Tensor) -> None:
        """ValueError for pixels the position table does not cover."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.spec.num_channels:
            raise ValueError(
                f"pixel_values must be [images, {self.spec.num_channels}, height, width]; got "
                f"{list(pixel_values.shape)}."
            )
        height, width = pixel_values.shape[2:]
        side, patch = self.spec.image_size, self.spec.patch_size
        if self.spec.bucketed_positions:
            if height > side or width > side or height % patch or width % patch:
                raise ValueError(
                    f"an image tile is {height}x{width} pixels; the vision tower takes tiles of "
                    f"at most {side}x{side} in multiples of its {patch}-pixel patches."
                )
        elif (height, width) != (side, side):
            raise ValueError(
                f"the image is {height}x{width} pixels; the vision tower takes {side}x{side}."
            )
