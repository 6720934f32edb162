"""A chat request's prompt text: its messages (and tools) through the chat template.

The template is the request's `chat_template`, else the server's --chat-template, else
the model's; with tools, or tool calls / results in the messages, one that ignores tools is
swapped for the shipped tool-aware ChatML (chat_templates/__init__.py).
"""

from __future__ import annotations

import jinja2

from services.frontend.chat_templates import template_for_tools
from services.frontend.openai.chat_messages import ChatMessage
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.tokenizer import apply_chat_template


def render_chat(
    tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    chat_template: str | None,
    tools: list[dict] | None = None,
    param: str = "messages",
) -> str:
    """The conversation as prompt text; template problems are the request's (400, naming
    `param` unless the request's own chat_template failed)."""
    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer, and this model has none.", param)
    template_messages = [m.as_template_message(i) for i, m in enumerate(messages)]
    template = chat_template
    if tools or any(m.has_tool_parts for m in messages):
        template = template_for_tools(tokenizer, chat_template)
    try:
        return apply_chat_template(
            tokenizer, template_messages, add_generation_prompt, template, tools=tools
        )
    except jinja2.TemplateError as exc:
        where = "chat_template" if chat_template is not None else param
        raise InvalidRequestError(f"the chat template failed: {exc}", where) from exc
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param) from exc
