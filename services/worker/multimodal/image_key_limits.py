"""Key limits of a step's rows for a model whose image tokens attend both ways (Gemma 3).

HF's Gemma 3 lets each run of consecutive image tokens (one image's) attend to every
position of the run, not only the earlier ones; all other rows stay causal. A row's key
limit is the number of keys it sees: its position + 1, or for an image token the run's
last position + 1. The paged kernels read only keys already written, and a step writes
its keys before it attends, so a run's rows see the whole run when the chunk holds it
whole (the scheduler never ends a chunk inside an image's span); a limit is never past
the chunk's end.
"""

from __future__ import annotations

import logging

import numpy as np

from services.worker.multimodal.image_slice import ImageSlice

logger = logging.getLogger(__name__)


def run_ends(is_image: np.ndarray) -> np.ndarray:
    """[n] one past the end of the run of True each position is in (or its first False
    at or after it; n when there is none)."""
    n = is_image.shape[0]
    stops = np.where(is_image, n, np.arange(n))  # [n] each position's own stop, if it is one
    return np.minimum.accumulate(stops[::-1])[::-1]


def image_key_limits(
    positions: np.ndarray,  # [T] int64 each row's position
    chunk_ends: np.ndarray,  # [T] int64 its sequence's seq_len this step
    slices: list[ImageSlice],
    token_rows: dict[str, np.ndarray],  # request id -> its token ids (prompt first)
    image_token_id: int,
) -> np.ndarray:
    """[T] int32 each row's key limit: causal but for the slices' rows (image tokens),
    which see their run's end, cut at the chunk's end."""
    limits = positions + 1  # [T]
    for piece in slices:
        image = piece.image
        span = token_rows[piece.request_id][image.offset : image.end]  # [length]
        ends = run_ends(span == image_token_id) + image.offset  # [length]
        wanted = ends[positions[piece.rows] - image.offset]  # [k]
        cut = chunk_ends[piece.rows]  # [k]
        if bool((wanted > cut).any()):
            logger.warning(
                "request %r: a chunk ends inside an image at %d (a span longer than a "
                "step's tokens): its image tokens do not see the whole image",
                piece.request_id,
                image.offset,
            )
        limits[piece.rows] = np.minimum(wanted, cut)
    return limits.astype(np.int32)
