"""Qwen2.5-VL's vision transformer: a Conv3d patch embedding over temporal_patch_size
frames (an image is its frame repeated), 2D rotary over each patch's (row, column),
pre-RMSNorm blocks with a gated SiLU MLP, attention within windows of merged tokens
except in `fullatt_block_indexes` (vision_windows.py), then the patch merger: each merge
block of m x m patches, RMSNormed, concatenated and through a two-linear GELU MLP into
one text-model row. The modules carry HF's names (`visual.*`); `prepare` (once, after
loading) packs every linear for oneDNN in the model's dtype (vision_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from services.worker.layers.activation import activation
from services.worker.layers.layernorm import RMSNorm
from services.worker.layers.rotary_embedding import apply_rotary, default_inv_freq
from services.worker.models.vision.vision_linear import VisionLinear
from services.worker.models.vision.vision_windows import patch_groups

NORM_EPS = 1e-6  # HF's, fixed for every norm of the tower


class VisionPatchEmbed(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.channels, self.frames = int(config.in_channels), int(config.temporal_patch_size)
        self.patch, hidden = int(config.patch_size), int(config.hidden_size)
        kernel = (self.frames, self.patch, self.patch)
        self.proj = nn.Conv3d(self.channels, hidden, kernel, stride=kernel, bias=False)

    @property
    def patch_features(self) -> int:
        return self.channels * self.frames * self.patch * self.patch

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, C * T * P * P] (the processor's flattened patches) -> [N, hidden]."""
        cubes = patches.view(-1, self.channels, self.frames, self.patch, self.patch)
        return self.proj(cubes).flatten(1)  # [N, hidden]


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.qkv = VisionLinear(hidden, 3 * hidden)
        self.proj = VisionLinear(hidden, hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        """x [N, hidden]; cos, sin [N, 1, head_dim]; groups: index tensors [G, L] of the
        patches that attend to each other (every patch in exactly one)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = torch.empty_like(q)
        for index in groups:

            def heads(t: torch.Tensor, index: torch.Tensor = index) -> torch.Tensor:
                return t[index].transpose(1, 2)  # [G, H, L, D]

            attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
            out[index] = attended.transpose(1, 2)  # [G, L, H, D]
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = VisionLinear(hidden, intermediate)
        self.up_proj = VisionLinear(hidden, intermediate)
        self.down_proj = VisionLinear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.norm1 = RMSNorm(hidden, NORM_EPS)
        self.attn = VisionAttention(hidden, int(config.num_heads))
        self.norm2 = RMSNorm(hidden, NORM_EPS)
        self.mlp = VisionMLP(hidden, int(config.intermediate_size), str(config.hidden_act))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x, x.dtype), cos, sin, groups)
        return x + self.mlp(self.norm2(x, x.dtype))


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int, out_hidden: int) -> None:
        super().__init__()
        self.merged = hidden * merge * merge
        self.ln_q = RMSNorm(hidden, NORM_EPS)
        # HF's nn.Sequential(linear, GELU, linear): its linears are mlp.0 and mlp.2
        self.mlp = nn.ModuleDict(
            {
                "0": VisionLinear(self.merged, self.merged),
                "2": VisionLinear(self.merged, out_hidden),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] in merge-block order -> [N / m^2, out_hidden]."""
        blocks = self.ln_q(x, x.dtype).reshape(-1, self.merged)
        return self.mlp["2"](self.mlp["0"](blocks, "none"))  # HF's nn.GELU(): exact erf


class Qwen2_5VisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, heads = int(config.hidden_size), int(config.num_heads)
        if hidden % heads or (hidden // heads) % 4:
            raise ValueError(
                f"the vision config's hidden_size {hidden} over {heads} heads must give a "
                "head size that is a multiple of 4 (2D rotary)."
            )
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        # windows of merged tokens per side (HF: window_size pixels)
        self.window = max(1, int(config.window_size) // self.merge // self.patch_size)
        self.full_attention = frozenset(int(i) for i in config.fullatt_block_indexes)
        self.patch_embed = VisionPatchEmbed(config)
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        # each of row and column takes a quarter of the head's features' frequencies
        self.register_buffer(
            "inv_freq", default_inv_freq(hidden // heads // 2, theta), persistent=False
        )
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(int(config.depth)))
        self.merger = PatchMerger(hidden, self.merge, int(config.out_hidden_size))

    def prepare(self) -> None:
        """Every linear packed, once, after loading."""
        for module in self.modules():
            if isinstance(module, VisionLinear):
                module.pack()

    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image: patches [t * h * w, C * T * P * P] of grid (t, h, w) -> its rows
        [t * h * w / m^2, out_hidden]."""
        self._check(patches, grid)
        weight = self.patch_embed.proj.weight
        x = self.patch_embed(patches.to(weight.device, weight.dtype))  # [N, hidden]
        cos, sin = self._cos_sin(grid)  # [N, 1, head_dim]
        windows = [g.to(x.device) for g in patch_groups(grid, self.merge, self.window)]
        frames = [g.to(x.device) for g in patch_groups(grid, self.merge, None)]
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if index in self.full_attention else windows)
        return self.merger(x)

    def _cos_sin(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's rotary cos and sin [N, 1, head_dim] float32: the first half of the
        angles from its row, the second from its column (then repeated, rotate-half)."""
        inv_freq = self.inv_freq.to(torch.float32)
        rows, cols = (p.to(inv_freq.device) for p in patch_rows_cols(grid, self.merge))  # [N]
        freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [N, 1, head_dim]
        return angles.cos(), angles.sin()

    def _check(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> None:
        t, h, w = grid
        if min(grid) < 1 or h % self.merge or w % self.merge:
            raise ValueError(
                f"image_grid_thw {list(grid)} is not a grid of whole {self.merge} x "
                f"{self.merge} merge blocks."
            )
        features = self.patch_embed.patch_features
        if patches.dim() != 2 or tuple(patches.shape) != (t * h * w, features):
            raise ValueError(
                f"Qwen2.5-VL's pixel_values must be [{t * h * w}, {features}] for "
                f"image_grid_thw {list(grid)}; got {list(patches.shape)}."
            )


def patch_rows_cols(grid: tuple[int, int, int], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in its frame, in the processor's merge-block order:
    ([N], [N]) float32."""
    t, h, w = grid
    row = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
    col = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
    # [h / m, w / m, m, m]: block row, block column, row within, column within
    rows = row.reshape(-1).repeat(t).to(torch.float32)
    cols = col.reshape(-1).repeat(t).to(torch.float32)
    return rows, cols
