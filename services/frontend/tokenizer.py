"""Tokenizer loading and chat templates (transformers' fast tokenizers)."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
# A template that loops over a message's content (`for part in message['content']`) reads
# content parts (HF processors' templates: SmolVLM's, LLaVA's); a string there would be
# iterated character by character and its text lost.
_LOOPS_OVER_CONTENT = re.compile(
    r"for\s+\w+\s+in\s+\w+\s*" r"(\[\s*['\"]content['\"]\s*\]|\.content\b)"
)


class TokenizerLoadError(ValueError):
    pass


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """The fast tokenizer saved with the model folder (no hub access)."""
    # Imported here: AutoTokenizer imports torch, and the chat-template sandbox's child
    # process imports this module to render (chat_templates/sandbox_child.py).
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise TokenizerLoadError(
            f"no usable tokenizer in {folder} (looked for tokenizer.json / tokenizer_config.json):"
            f" {exc}"
        ) from exc
    if not tokenizer.is_fast:
        raise TokenizerLoadError(f"the tokenizer in {folder} is not a fast tokenizer.")
    return tokenizer


def try_load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer, or None (with a warning) when it has none that works."""
    try:
        return load_tokenizer(folder)
    except TokenizerLoadError as exc:
        logger.warning("%s; only token-id prompts will work and outputs have no text", exc)
        return None


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """Render a conversation to the prompt text the model was trained on; `tools` (OpenAI
    tool definitions) go to the template as HF templates expect them, `template_kwargs`
    as the template's own variables (enable_thinking)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be a dict with a 'role' and a 'content'.")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("the model's tokenizer has no chat template; pass chat_template.")
    as_parts = reads_content_parts(chat_template or tokenizer.chat_template)
    return tokenizer.apply_chat_template(
        [_flatten_content(m, as_parts) for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tools=tools,
        **(template_kwargs or {}),
    )


def reads_content_parts(template) -> bool:
    """Whether the template (or any of a model's named templates) loops over content."""
    if isinstance(template, dict):
        return any(reads_content_parts(t) for t in template.values())
    return isinstance(template, str) and _loops_over_content(template)


@functools.lru_cache(maxsize=64)
def _loops_over_content(template: str) -> bool:
    return _LOOPS_OVER_CONTENT.search(template) is not None


def _flatten_content(message: dict, as_parts: bool = False) -> dict:
    """OpenAI-style content parts [{"type": "text", "text": ...}] joined into one string; a
    message with image parts ({"type": "image"}, what chat_images.split_images leaves), or
    any message for a template that reads parts (`as_parts`), gets its content as parts,
    as HF processors' chat templates expect them."""
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, str):
        if not as_parts:
            return {**message, "content": content}
        content = [{"type": "text", "text": content}] if content else []
    if not isinstance(content, list):
        raise ValueError("message content must be a string or a list of text parts.")
    parts = [_template_part(part) for part in content]
    if as_parts or any(part["type"] == "image" for part in parts):
        return {**message, "content": parts}
    return {**message, "content": "".join(part["text"] for part in parts)}


def _template_part(part) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image":
        return {"type": "image"}
    if kind != "text":
        raise ValueError(
            f"content parts of type {kind!r} are not supported in messages (text, and images "
            "for a vision-language model)."
        )
    return {"type": "text", "text": part.get("text") or ""}
