"""Chat templates shipped with pagestream, the choice of template for a request with tools,
and the one rendering of a conversation (inline for the model's and the operator's
templates, inside the sandbox's child process for a request's own: template_sandbox.py).

Why: many small chat models (the default SmolLM2 among them) have a ChatML template with
no tools section, so tool definitions would silently vanish from the prompt. When a
request has tools (or tool calls / tool results in its messages) and the template it would
use renders the same text with and without tools, the request is rendered with the
shipped tool-aware ChatML template instead, with a warning logged once per template.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import logging
from collections import OrderedDict
from pathlib import Path

from services.frontend.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)
TOOL_CHATML = "tool_chatml.jinja"
_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@functools.cache
def shipped_template(name: str = TOOL_CHATML) -> str:
    return importlib.resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def load_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the template text itself (as vLLM reads it)."""
    if any(char in value for char in "{}\n"):
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template.")
    return path.read_text(encoding="utf-8")


def render_conversation(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    chat_template: str | None,
    tools: list[dict] | None,
    uses_tools: bool,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text of a conversation; `uses_tools` (tools, or tool calls / results in
    the messages) swaps a template that ignores tools for the shipped tool-aware one."""
    template = template_for_tools(tokenizer, chat_template) if uses_tools else chat_template
    return apply_chat_template(
        tokenizer, messages, add_generation_prompt, template, tools, template_kwargs
    )


def renders_tools(tokenizer, chat_template: str | None) -> bool:
    """Whether the template puts tool definitions into the prompt at all."""
    template = chat_template or tokenizer.chat_template
    text = template if isinstance(template, str) else repr(template)
    key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return _renders_tools(tokenizer, key, chat_template)


# Probe results by template digest; bounded, since a trusting server renders requests' own
# templates (in the sandbox's child, which has its own copy of this cache).
_SEEN_MAX = 64
_seen: OrderedDict[str, bool] = OrderedDict()


def _renders_tools(tokenizer, key: str, chat_template: str | None) -> bool:
    if key in _seen:
        _seen.move_to_end(key)
        return _seen[key]

    def render(tools):
        return tokenizer.apply_chat_template(
            _PROBE_MESSAGES,
            tools=tools,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )

    try:
        result = render(_PROBE_TOOLS) != render(None)
    except Exception:  # a template that breaks on tools does not render them either
        result = False
    if not result:
        logger.warning(
            "the chat template ignores tools; requests with tools use pagestream's "
            "tool-aware ChatML template (%s). Pass --chat-template to use another.",
            TOOL_CHATML,
        )
    _seen[key] = result
    if len(_seen) > _SEEN_MAX:
        _seen.popitem(last=False)
    return result


def template_for_tools(tokenizer, chat_template: str | None) -> str | None:
    """The template to render a conversation with tools: the given (or model's) one when
    it renders tools, else the shipped tool-aware ChatML."""
    if tokenizer.chat_template is None and chat_template is None:
        return shipped_template()
    if renders_tools(tokenizer, chat_template):
        return chat_template
    return shipped_template()
