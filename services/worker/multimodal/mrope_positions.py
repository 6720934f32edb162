"""M-RoPE positions of a prompt (Qwen2.5-VL): three rows (temporal, row, column).

Text tokens count up with all three equal. An image's span starting at position p (the
count so far) holds its merged patches in (frame, row, column) order with positions
(p + frame, p + row, p + column); the count then moves on by the larger side of its
merged grid, so the text after it continues from there. A token past the prompt (a
generated one) at index i has all three at i + delta, delta = max(prompt's positions)
+ 1 - prompt length (HF's rope_deltas): the rotary position differs from the KV slot
index by a fixed amount per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.image_input import ImageInput

Grid = tuple[int, int, int]  # (t, h, w) in patches: the processor's image_grid_thw


def mrope_positions(
    prompt_len: int, spans: Sequence[tuple[int, int, Grid]], merge: int
) -> tuple[np.ndarray, int]:
    """spans: each image's (offset, length, grid), in prompt order and disjoint ->
    (positions [3, prompt_len] int64, delta); ValueError for a span whose length is not
    its grid's merged patches."""
    parts, cursor, count = [], 0, 0
    for offset, length, (t, h, w) in spans:
        rows, cols = h // merge, w // merge
        if h % merge or w % merge or length != t * rows * cols or offset < cursor:
            raise ValueError(
                f"an image span of {length} tokens at {offset} does not hold its grid "
                f"{[t, h, w]}'s {t * rows * cols} merged patches."
            )
        parts.append(np.broadcast_to(count + np.arange(offset - cursor), (3, offset - cursor)))
        count += offset - cursor
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij"))
        parts.append(count + grid.reshape(3, -1))  # [3, t * rows * cols]
        count += max(rows, cols)
        cursor = offset + length
    if cursor > prompt_len:
        raise ValueError(f"an image span ends at {cursor}, past the prompt's {prompt_len}.")
    parts.append(np.broadcast_to(count + np.arange(prompt_len - cursor), (3, prompt_len - cursor)))
    positions = np.concatenate(parts, axis=1).astype(np.int64)  # [3, prompt_len]
    delta = int(positions.max()) + 1 - prompt_len if prompt_len else 0
    return positions, delta


def prompt_mrope_positions(
    images: Sequence[ImageInput], prompt_len: int, merge: int
) -> tuple[np.ndarray, int]:
    """mrope_positions of a prompt's images, each grid from its image_grid_thw [1, 3]."""
    spans = []
    for image in images:
        grid = np.asarray(image.data.get("image_grid_thw", ()))
        if grid.shape != (1, 3) or not np.issubdtype(grid.dtype, np.integer) or grid.min() < 1:
            raise ValueError("a Qwen2.5-VL image needs its image_grid_thw: [1, 3] positive ints.")
        t, h, w = (int(v) for v in grid[0])
        spans.append((image.offset, image.length, (t, h, w)))
    return mrope_positions(prompt_len, spans, merge)


def rope_positions(token_index: np.ndarray, prompt_positions: np.ndarray, delta: int) -> np.ndarray:
    """One request's tokens at KV indices token_index [n] -> their M-RoPE positions
    [3, n]: the prompt's table inside the prompt, index + delta past it."""
    prompt_len = prompt_positions.shape[1]
    inside = token_index < prompt_len  # [n]
    out = np.broadcast_to(token_index + delta, (3, len(token_index))).copy()
    out[:, inside] = prompt_positions[:, token_index[inside]]
    return out
