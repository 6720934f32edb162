"""ImageSlice: the rows of one step that take one image's embeddings.

A chunk of a request's prompt may cut through an image's span (chunked prefill, a prefix
hit or a preemption starting inside it); the chunk's rows at span positions holding the
image token take the encoder output rows of the same rank among the span's image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.image_input import ImageInput


@dataclass(frozen=True)
class ImageSlice:
    request_id: str
    image: ImageInput
    rows: np.ndarray  # [k] int64 flat rows of the step
    embed_index: np.ndarray  # [k] int64 rows of the image's encoder output
    done: bool  # the chunk reaches the span's end: the request needs its output no more


def image_slices(
    request_id: str,
    images: tuple[ImageInput, ...],
    token_row: np.ndarray,  # [>= prompt length] the request's token ids
    start: int,  # the chunk's first position
    num: int,  # the chunk's tokens
    first_row: int,  # the flat row of position `start`
    image_token_id: int,
) -> list[ImageSlice]:
    """The chunk's slices, one per image whose span it touches; ValueError when a span
    does not hold exactly num_embeds image tokens (the frontend's spans are wrong)."""
    slices = []
    end = start + num
    for image in images:
        if not image.overlaps(start, end):
            continue
        is_image = token_row[image.offset : image.end] == image_token_id  # [length]
        if int(is_image.sum()) != image.num_embeds:
            raise ValueError(
                f"request {request_id!r}: an image's span at {image.offset} holds "
                f"{int(is_image.sum())} image tokens, not its {image.num_embeds} embeddings"
            )
        rank = np.cumsum(is_image) - 1  # [length] each image token's encoder row
        lo, hi = max(start, image.offset), min(end, image.end)
        positions = np.arange(lo, hi)
        positions = positions[is_image[positions - image.offset]]
        slices.append(
            ImageSlice(
                request_id,
                image,
                rows=positions - start + first_row,
                embed_index=rank[positions - image.offset],
                done=end >= image.end,
            )
        )
    return slices
