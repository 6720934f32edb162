"""The step's encoder budget: how many image embeddings the worker may compute in one step.

The worker encodes an image in the step whose chunk first touches its placeholder span
and keeps the output until the request's prefill passes the span. A chunk that starts
inside a span needs the image encoded again only when the worker does not hold the
request (its first chunk after admission or a preemption). Images are charged their
embedding count; the budget is max_num_batched_tokens, as vLLM's
max_num_encoder_input_tokens defaults to. An image larger than the whole budget still
runs, alone, in a step whose budget is untouched (else it would never run).

An image's span is computed in one step: a chunk never ends inside it, and a prefix hit
that would is cut back to the span's block. A model whose image tokens attend to each
other both ways (Gemma 3) needs every key of the image in the cache when its rows
attend; for the causal families it changes only where chunks end (the scheduler does not
know which kind it serves, so it does this for every VLM). A span longer than one step's
tokens for a request (max_chunk) is split: it could not run otherwise.
"""

from __future__ import annotations

from services.common.image_input import ImageInput


def images_to_encode(
    images: tuple[ImageInput, ...], start: int, num_new: int, fresh: bool
) -> list[ImageInput]:
    """The images a chunk of positions start .. start + num_new - 1 has the worker encode
    (`fresh`: the worker does not hold the request yet)."""
    end = start + num_new
    return [i for i in images if i.overlaps(start, end) and (fresh or i.offset >= start)]


def ends_inside_image(images: tuple[ImageInput, ...], end: int) -> bool:
    """Whether positions .. end - 1 stop strictly inside an image's span."""
    return any(i.offset < end < i.end for i in images)


def fit_chunk(
    images: tuple[ImageInput, ...],
    start: int,
    num_new: int,
    fresh: bool,
    budget_left: int,
    budget_untouched: bool,
    max_chunk: int | None = None,
) -> tuple[int, int]:
    """(the chunk's tokens, the encoder tokens they use): the chunk cut before the first
    image that does not fit what is left of the budget, then before the span it would end
    inside (0 tokens when that is its first position; a span longer than `max_chunk`, the
    most tokens a step computes for one request, None: no bound, may be split)."""
    num, used = _within_budget(images, start, num_new, fresh, budget_left, budget_untouched)
    end = start + num
    for image in images:
        whole = max_chunk is None or image.length <= max_chunk
        if start <= image.offset < end < image.end and whole:
            end = image.offset
            used = sum(i.num_embeds for i in images_to_encode(images, start, end - start, fresh))
    return end - start, used


def _within_budget(
    images: tuple[ImageInput, ...],
    start: int,
    num_new: int,
    fresh: bool,
    budget_left: int,
    budget_untouched: bool,
) -> tuple[int, int]:
    """fit_chunk's cut for the encoder budget alone."""
    used = 0
    for image in images_to_encode(images, start, num_new, fresh):
        alone = budget_untouched and used == 0
        if used + image.num_embeds > budget_left and not alone:
            return max(min(image.offset, start + num_new) - start, 0), used
        used += image.num_embeds
    return num_new, used
