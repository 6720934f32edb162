"""A conversation's images: each image content part out of the messages, in order.

The parts every API's messages arrive with: OpenAI chat's image_url (an object with a
url, or the bare string), the Responses API's input_image, and in LLM.chat a PIL image
(vLLM's image_pil). Each becomes {"type": "image"}, the part HF processors' chat templates
render as the model's image marker; what it named (a URL string or a PIL image) is
returned beside the messages in prompt order.
"""

from __future__ import annotations

IMAGE_PART_TYPES = ("image_url", "input_image", "image_pil", "image")
TEMPLATE_PART = {"type": "image"}


def split_images(messages: list[dict]) -> tuple[list[dict], list]:
    """(messages with image parts as {"type": "image"}, the images they named)."""
    images: list = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                images.append(image_of(part, f"messages[{i}].content[{j}]"))
                parts.append(TEMPLATE_PART)
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def has_images(messages: list[dict]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
    )


def image_of(part: dict, where: str):
    """The URL string (or PIL image) an image part names; ValueError naming a bad one."""
    kind = part["type"]
    if kind == "image_pil":
        return part.get("image_pil")
    if kind == "image":
        value = part.get("image", part.get("url"))
    else:
        value = part.get("image_url")
        if isinstance(value, dict):
            value = value.get("url")
    if isinstance(value, str) and value:
        return value
    if kind == "image" and value is not None and hasattr(value, "convert"):
        return value  # a PIL image, HF's own part form
    raise ValueError(f"{where}: an {kind} part needs a url string (a data URL or a URL).")
