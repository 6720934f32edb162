"""A chat request's prompt text: its messages (and tools) through the chat template.

The template is the request's `chat_template` (refused unless the server trusts request
templates; then rendered in the sandbox: chat_renderer.py), else the server's
--chat-template, else the model's; with tools, or tool calls / results in the messages, one
that ignores tools is swapped for the shipped tool-aware ChatML (chat_templates/__init__.py).
"""

from __future__ import annotations

import jinja2

from services.frontend.chat_renderer import ChatTemplateError
from services.frontend.openai.chat_messages import ChatMessage
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.request_limits import LimitExceededError


async def render_chat(
    frontend,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    request_template: str | None,
    server_template: str | None = None,
    tools: list[dict] | None = None,
    param: str = "messages",
    template_kwargs: dict | None = None,
) -> str:
    """The conversation as prompt text; template problems are the request's (400, naming
    `param` unless the request's own chat_template failed)."""
    if frontend.tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer, and this model has none.", param)
    template_messages = [m.as_template_message(i) for i, m in enumerate(messages)]
    uses_tools = bool(tools) or any(m.has_tool_parts for m in messages)
    try:
        return await frontend.chat_renderer.render(
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
