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
        _check_count(len(contents), self.config.max_messages, param, "messages", "max_messages")
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

    def check_prompts(self, num_prompts: int, n: int = 1, param: str = "prompt") -> None:
        """A prompt array: how many prompts, and the sequences they start (prompts x n)."""
        _check_count(num_prompts, self.config.max_prompts, param, "prompts", "max_prompts")
        sequences = num_prompts * n
        limit = self.config.max_sequences
        if sequences > limit:
            raise LimitExceededError(
                f"{param} has {num_prompts} prompts with n={n}: {sequences} sequences, more "
                f"than the limit of {limit} (max_sequences, --max-sequences).",
                param,
            )

    def check_tools(self, tools, param: str = "tools") -> None:
        _check_count(len(tools or ()), self.config.max_tools, param, "tools", "max_tools")

    def check_sampling(self, params) -> None:
        """A SamplingParams' client-sized fields: stop strings (count and length),
        stop_token_ids and logit_bias (entries). Each stop string costs the detokenizer
        work per token, and the lists are kept for the request's life."""
        config = self.config
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or ())
        _check_count(len(stops), config.max_stop_sequences, "stop", "stop strings", _STOPS)
        longest = max(map(len, stops), default=0)
        if config.max_stop_sequence_chars and longest > config.max_stop_sequence_chars:
            raise LimitExceededError(
                f"stop has a string of {longest} characters, more than the limit of "
                f"{config.max_stop_sequence_chars} (max_stop_sequence_chars, "
                "--max-stop-sequence-chars).",
                "stop",
            )
        stop_ids = params.stop_token_ids or ()
        _check_count(len(stop_ids), config.max_stop_token_ids, "stop_token_ids", "ids", _STOP_IDS)
        bias = params.logit_bias or {}
        _check_count(len(bias), config.max_logit_bias, "logit_bias", "entries", "max_logit_bias")

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


_STOPS = "max_stop_sequences"
_STOP_IDS = "max_stop_token_ids"


def _check_count(count: int, limit: int, param: str, what: str, option: str) -> None:
    """`count` items of `param` within `limit` (0: no limit), else a 400 naming the flag."""
    if limit and count > limit:
        raise LimitExceededError(
            f"{param} has {count} {what}, more than the limit of {limit} "
            f"({option}, --{option.replace('_', '-')}).",
            param,
        )


def _utf8_size(text: str) -> int:
    """Bytes of `text` in UTF-8, without encoding it when every character is one byte."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
