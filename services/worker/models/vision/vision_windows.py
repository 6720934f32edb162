"""Which patches of a Qwen2.5-VL image attend to each other: windows of merged tokens in
the windowed layers, each frame whole in the full-attention layers.

The processor orders an image's patches merge block by merge block: patch p belongs to
merged token p // m^2, and merged tokens run row-major over the frame's (h / m, w / m)
grid, frame after frame. A window is a square of `window` x `window` merged tokens (the
grid's last row and column of windows may be cut short). Attention within a group is
order-free (rotary is per patch), so a group is a set of patch indices: no reordering of
the rows, and groups of equal size run as one batch.
"""

from __future__ import annotations

import torch


def patch_groups(grid: tuple[int, int, int], merge: int, window: int | None) -> list[torch.Tensor]:
    """grid (t, h, w) in patches -> the patch indices that attend together, as index
    tensors [groups, size] int64, one per distinct group size; `window` in merged tokens
    per side, None: each frame is one group."""
    t, h, w = grid
    rows, cols = h // merge, w // merge  # merged tokens per side
    frame = torch.arange(t)[:, None, None].expand(t, rows, cols)
    if window is None:
        group = frame  # [t, rows, cols]
    else:
        across = -(-cols // window)  # windows per row of windows
        down = -(-rows // window)
        row_window = (torch.arange(rows) // window)[None, :, None]
        col_window = (torch.arange(cols) // window)[None, None, :]
        group = (frame * down + row_window) * across + col_window  # [t, rows, cols]
    per_patch = group.reshape(-1).repeat_interleave(merge * merge)  # [N]
    order = torch.argsort(per_patch, stable=True)  # patches grouped, each group in order
    sizes = torch.bincount(per_patch)
    sizes = sizes[sizes > 0]
    starts = torch.cumsum(sizes, 0) - sizes
    batches = []
    for size in torch.unique(sizes).tolist():
        first = starts[sizes == size]  # [groups]
        batches.append(order[first[:, None] + torch.arange(size)[None, :]])  # [groups, size]
    return batches
