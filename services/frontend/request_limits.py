"""RequestLimits: cheap checks on a request before anything tokenizes or renders it.

Tokenizing and chat templates run on the event loop, so a prompt of many megabytes or a
conversation of a million messages would stall every other request; these checks refuse
them first, by size alone. Each refusal is a LimitExceededError (a ValueError: HTTP 400,
gRPC INVALID_ARGUMENT) whose message names the request field, the limit and its flag.
"""

from __future__ import annotations

from services.frontend.frontend_config import FrontendConfig

__all__ = ["LimitExceededError", "RequestLimits"]


# OpenAI's error code for a prompt over the context (clients match it to trim history).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class LimitExceededError(ValueError):
    """A request over one of the frontend's limits; `param` is the request's field, `code`
    OpenAI's error code."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class RequestLimits:
    def __init__(self, config: FrontendConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.max_prompt_bytes = config.prompt_bytes_limit(max_model_len)

    def check_prompt_text(self, text: str, param: str = "prompt") -> None:
        """A text prompt's size in UTF-8 bytes."""
        self._check_bytes(_utf8_size(text), param)

    def check_messages(self, contents: list[str], param: str = "messages") -> None:
        """Chat messages: how many, and their text together."""
        limit = self.config.max_messages
        if limit and len(contents) > limit:
            raise LimitExceededError(
                f"{param} has {len(contents)} messages, more than the limit of {limit} "
                "(max_messages, --max-messages).",
                param,
            )
        self._check_bytes(sum(_utf8_size(c) for c in contents), param)

    def check_token_ids(self, token_ids, param: str = "prompt") -> None:
        """A prompt given as token ids can never be longer than the context."""
        if len(token_ids) > self.max_model_len:
            raise LimitExceededError(
                f"{param} has {len(token_ids)} tokens, more than the maximum context length "
                f"max_model_len={self.max_model_len}.",
                param,
                CONTEXT_LENGTH_EXCEEDED,
            )

    def check_n(self, n: int, param: str = "n") -> None:
        if n > self.config.max_n:
            raise LimitExceededError(
                f"{param} is {n}, more than the limit of {self.config.max_n} (max_n, --max-n).",
                param,
            )

    def check_max_tokens(self, max_tokens: int | None, param: str = "max_tokens") -> None:
        """Every prompt has a token, so max_tokens must leave room for one in the context."""
        if max_tokens is not None and max_tokens >= self.max_model_len:
            raise LimitExceededError(
                f"{param} is {max_tokens}, but the maximum context length is "
                f"{self.max_model_len} tokens, prompt included (max_model_len): "
                f"ask for at most {self.max_model_len - 1}.",
                param,
            )

    def _check_bytes(self, size: int, param: str) -> None:
        limit = self.max_prompt_bytes
        if limit and size > limit:
            raise LimitExceededError(
                f"{param} is {size} bytes of text, more than the limit of {limit} "
                "(max_prompt_bytes, --max-prompt-bytes).",
                param,
            )


def _utf8_size(text: str) -> int:
    """Bytes of `text` in UTF-8, without encoding it when every character is one byte."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
