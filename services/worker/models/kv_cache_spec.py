"""What the paged KV cache needs to know about a model: its layers' cache shape, and how
they share block tables (KV cache groups)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagestream_kernels import q8_0


@dataclass(frozen=True)
class KVCacheGroups:
    """Layers that share one block table per request (vLLM's KV cache groups).

    A hybrid model (full-attention layers beside sliding-window ones, Gemma 3's 1 : 5) puts
    each kind in groups of one size, `group_size` (the smaller kind's count), so a block
    holds `group_size` layers' KV wherever it lies: slot s of every group shares one cache
    tensor, and a windowed group's blocks behind the window are freed while the full
    groups keep theirs. Any other model is one group of all its layers."""

    windows: tuple[int, ...]  # per group: its layers' window (0: full attention)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers' indices, in order

    @classmethod
    def single(cls, num_layers: int, window: int = 0) -> KVCacheGroups:
        return cls((window,), (tuple(range(num_layers)),))

    @classmethod
    def from_windows(cls, windows: Sequence[int | None]) -> KVCacheGroups:
        """The grouping of layers with these windows (None / 0: full attention): one group
        unless full and windowed layers mix (then every windowed group frees behind the
        widest window)."""
        full = [i for i, w in enumerate(windows) if not w]
        windowed = [i for i, w in enumerate(windows) if w]
        window = max((int(windows[i] or 0) for i in windowed), default=0)  # the widest bounds
        if not full or not windowed:
            return cls.single(len(windows), window)
        size = min(len(full), len(windowed))
        chunks = [full[i : i + size] for i in range(0, len(full), size)]
        num_full = len(chunks)
        chunks += [windowed[i : i + size] for i in range(0, len(windowed), size)]
        group_windows = tuple(0 if g < num_full else window for g in range(len(chunks)))
        return cls(group_windows, tuple(tuple(c) for c in chunks))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def group_size(self) -> int:
        """Cache tensors the groups need: the largest group's layers."""
        return max(len(layers) for layers in self.layers)

    def placement(self) -> list[tuple[int, int]]:
        """Per layer (in model order) its (group, slot): the block table it reads and the
        cache tensor it writes."""
        where = {
            layer: (g, s) for g, group in enumerate(self.layers) for s, layer in enumerate(group)
        }
        return [where[layer] for layer in sorted(where)]


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one layer's cache: [2, num_blocks, block_size, num_kv_heads, row] with row =
    head_dim values, or (q8_0) each head's q8_0 row of uint8 (pagestream_kernels/q8_0.py:
    int8 codes then float16 scales, row_bytes(head_dim) bytes); with `layer_slots` layers
    share tensors (KV cache groups: layer i writes tensor layer_slots[i]), else each has
    its own."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layer_slots: tuple[int, ...] = ()
    q8_0: bool = False  # dtype is then torch.uint8

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.layer_slots and len(self.layer_slots) != self.num_layers:
            raise ValueError(f"layer_slots must name {self.num_layers} slots")
        if self.q8_0:
            q8_0.check_head_dim(self.head_dim)
            if self.dtype != torch.uint8:
                raise ValueError(f"a q8_0 KV cache is stored as torch.uint8, not {self.dtype}")

    @property
    def row(self) -> int:
        """The last dim of a cache tensor: a head's values, or its q8_0 row's bytes."""
        return q8_0.row_bytes(self.head_dim) if self.q8_0 else self.head_dim

    @property
    def num_tensors(self) -> int:
        return max(self.layer_slots) + 1 if self.layer_slots else self.num_layers

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.row)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """2 * num_tensors * block_size * num_kv_heads * row * dtype_size (q8_0: 34 bytes
        per 32 values, 17/32 of a bfloat16 cache's)."""
        itemsize = (dtype or self.dtype).itemsize
        return 2 * self.num_tensors * block_size * self.num_kv_heads * self.row * itemsize
