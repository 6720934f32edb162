"""A chat request's prompt text: its messages (and tools) through the chat template.

The template is the request's `chat_template` (refused unless the server trusts request
templates; then rendered in the sandbox: chat_renderer.py), else the server's
--chat-template, else the model's; with tools, or tool calls / results in the messages, one
that ignores tools is swapped for the shipped tool-aware ChatML (chat_templates/__init__.py).
Image parts render as {"type": "image"} (the model's image marker) and come back beside the
text, in prompt order; a model without an image processor refuses them by name.
"""

from __future__ import annotations

import jinja2

from services.frontend.chat_renderer import ChatTemplateError
from services.frontend.multimodal.chat_images import IMAGE_PART_TYPES, split_images
from services.frontend.multimodal.image_processor import NO_IMAGES
from services.frontend.openai.chat_messages import ChatMessage
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.request_limits import LimitExceededError


async def render_chat(frontend, messages: list[ChatMessage], *args, **kwargs) -> str:
    """The conversation as prompt text (render_chat_images' text)."""
    text, _ = await render_chat_images(frontend, messages, *args, **kwargs)
    return text


async def render_chat_images(
    frontend,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    request_template: str | None,
    server_template: str | None = None,
    tools: list[dict] | None = None,
    param: str = "messages",
    template_kwargs: dict | None = None,
) -> tuple[str, list]:
    """The conversation as prompt text, and the images its parts name (URL strings, in
    prompt order); template problems are the request's (400, naming `param` unless the
    request's own chat_template failed)."""
    if frontend.tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer, and this model has none.", param)
    template_messages, images = _split_images(frontend, messages, param)
    uses_tools = bool(tools) or any(m.has_tool_parts for m in messages)
    try:
        text = await frontend.chat_renderer.render(
            template_messages,
            add_generation_prompt,
            request_template=request_template,
            server_template=server_template,
            tools=tools,
            uses_tools=uses_tools,
            template_kwargs=template_kwargs,
        )
    except ChatTemplateError as exc:
        raise InvalidRequestError(str(exc), "chat_template") from exc
    except LimitExceededError as exc:
        raise InvalidRequestError(str(exc), exc.param or "chat_template") from exc
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"the chat template failed: {exc}", param) from exc
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param) from exc
    except Exception as exc:
        if not template_kwargs:
            raise
        # the client's variables broke the server's template (a string where it counts)
        raise InvalidRequestError(
            f"the chat template failed with these chat_template_kwargs: {exc}",
            "chat_template_kwargs",
        ) from exc
    return text, images


def _split_images(frontend, messages: list[ChatMessage], param: str) -> tuple[list[dict], list]:
    template_messages = [m.as_template_message(i) for i, m in enumerate(messages)]
    try:
        template_messages, images = split_images(template_messages)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param) from exc
    if images and frontend.input_processor.images is None:
        where = _first_image_part(messages, param)
        raise InvalidRequestError(f"{where}: {NO_IMAGES}; send text only.", param)
    return template_messages, images


def _first_image_part(messages: list[ChatMessage], param: str) -> str:
    """Where the first image part is ("messages[i].content[j]")."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if part.type in IMAGE_PART_TYPES:
                return f"{param}[{i}].content[{j}]"
    return param
