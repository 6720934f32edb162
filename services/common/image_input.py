"""ImageInput: one image of a prompt as the frontend's HF processor left it.

The frontend expands each image's marker into its placeholder tokens; the image then
owns the prompt positions offset .. offset + length - 1 (its span: the image tokens and
whatever the family puts between them, Idefics3's tile markers). Exactly `num_embeds`
positions of the span hold the model's image token id; the encoder's output rows
[num_embeds, hidden] replace those positions' embeddings in order. `content_hash` names
the pixels (and how they were processed): it is part of the block hashes of every block
the span touches, so two prompts with the same text and different images share no block.
`data` is this image's own slice of the processor's tensors (pixel_values, and the
family's extras: pixel_attention_mask, image_sizes, image_grid_thw).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    offset: int
    length: int
    num_embeds: int
    content_hash: str
    data: dict[str, np.ndarray] = field(default_factory=dict, compare=False)

    @property
    def end(self) -> int:
        """One past the span's last position."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions start .. end - 1 touch the span."""
        return self.offset < end and start < self.end

    def check(self, prompt_len: int) -> None:
        """ValueError unless the span lies in the prompt and holds its embeddings."""
        if not (self.offset >= 0 and 0 < self.num_embeds <= self.length):
            raise ValueError(
                f"an image's placeholder span (offset {self.offset}, length {self.length}, "
                f"{self.num_embeds} embeddings) is malformed."
            )
        if self.end > prompt_len:
            raise ValueError(
                f"an image's placeholder span ends at {self.end}, past the prompt's "
                f"{prompt_len} tokens."
            )


def check_images(images: tuple[ImageInput, ...], prompt_len: int) -> None:
    """Each span valid, in order and disjoint (ValueError naming the first that is not)."""
    end = 0
    for image in images:
        image.check(prompt_len)
        if image.offset < end:
            raise ValueError("images' placeholder spans must be in prompt order and disjoint.")
        end = image.end


def images_in_block(images: tuple[ImageInput, ...], start: int, end: int) -> tuple[str, ...]:
    """The content hashes of the images whose spans touch positions start .. end - 1 (a
    block's extra hash keys)."""
    return tuple("image=" + i.content_hash for i in images if i.overlaps(start, end))
