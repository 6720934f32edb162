"""process_image_prompt: a rendered prompt and the images its markers stand for -> the
processed prompt (token ids with each image expanded, one ImageInput per image).

The serving APIs (OpenAI chat, Responses, Anthropic, public gRPC) all come here: the
model is checked to take images and the count against the limit before anything is
read; loading, decoding and the HF processor then run in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio

from services.frontend.input_processor import ProcessedPrompt
from services.frontend.multimodal.image_processor import NO_IMAGES


async def process_image_prompt(
    frontend, text: str, images: list, add_special_tokens: bool
) -> ProcessedPrompt:
    """`frontend`: a Frontend (its input processor and image loader); ValueError naming
    the problem."""
    _check(frontend, images)
    return await asyncio.to_thread(_process, frontend, text, images, add_special_tokens)


async def image_prompt_ids(frontend, text: str, images: list, add_special_tokens: bool):
    """The token ids alone, not held to the context length (what tokenize and
    count_tokens report: a client counts to learn whether its conversation fits)."""
    _check(frontend, images)
    return await asyncio.to_thread(_expand, frontend, text, images, add_special_tokens)


def _check(frontend, images: list) -> None:
    if frontend.input_processor.images is None:
        raise ValueError(NO_IMAGES + "; send text only.")
    frontend.image_loader.check_count(len(images))


def _expand(frontend, text: str, images: list, add_special_tokens: bool) -> list[int]:
    decoded = frontend.image_loader.load_all(images)
    ids, _ = frontend.input_processor.images.process(text, decoded, add_special_tokens)
    return ids


def _process(frontend, text: str, images: list, add_special_tokens: bool) -> ProcessedPrompt:
    decoded = frontend.image_loader.load_all(images)
    prompt = {"prompt": text, "multi_modal_data": {"image": decoded}}
    return frontend.input_processor.process(prompt, add_special_tokens)
