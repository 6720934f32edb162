"""What the paged KV cache needs to know about a model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one layer's cache: [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """2 * num_layers * block_size * num_kv_heads * head_dim * dtype_size."""
        itemsize = (dtype or self.dtype).itemsize
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize
