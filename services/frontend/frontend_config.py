"""FrontendConfig: the frontend's protections, all checked before the engine sees a request.

Limits checked before tokenizing (request_limits.py), the server-side request timeout and
the bound on what a slow consumer may leave unread (output_queue.py), and the bounds of the
Responses API's store of responses (openai/response_store.py). The defaults let any
request that could fit the model's context through and keep a stalled or hostile client
from costing the engine or the event loop more than a bounded amount.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.flags import flag

MIB = 1024 * 1024
# A token is rarely more than a few bytes of text (English ~4, CJK ~3 per character, long
# whitespace or punctuation runs up to ~16); 32 bytes per token of context lets any prompt
# through that could fit, and bounds the tokenizer's work (on the event loop) per request.
PROMPT_BYTES_PER_TOKEN = 32


@dataclass(frozen=True)
class FrontendConfig:
    max_prompt_bytes: int | None = flag(
        None,
        "refuse (400) text prompts, or chat messages together, over this many UTF-8 bytes, "
        "before tokenizing (default: 32 x the context length; 0: no limit)",
    )
    max_messages: int = flag(1024, "chat messages per request (0: any)")
    max_n: int = flag(128, "sequences (n, beam width) per prompt, as OpenAI caps n")
    max_request_body_bytes: int = flag(
        16 * MIB, "refuse (400) HTTP request bodies over this size (0: no limit)"
    )
    request_timeout_s: float | None = flag(
        None,
        "abort requests that run longer than this many seconds (gRPC DEADLINE_EXCEEDED, "
        "HTTP 504); default: no limit",
        name="request-timeout",
    )
    max_unread_tokens: int = flag(
        4096,
        "abort a stream whose client leaves more than this many tokens unread (a client "
        "that stopped reading; 0: no bound)",
    )
    responses_store_max_entries: int = flag(
        1000,
        "Responses API: responses kept for GET /v1/responses/{id} and previous_response_id, "
        "least recently used evicted first (0: keep none)",
    )
    responses_store_max_age_s: float = flag(
        3600.0,
        "Responses API: forget a stored response this many seconds after it was stored",
        name="responses-store-max-age",
    )
    responses_store_max_bytes: int = flag(
        64 * MIB,
        "Responses API: the stored responses' JSON together, at most (0: no bound but the "
        "entry count)",
    )

    def __post_init__(self) -> None:
        for name in (
            "max_messages",
            "max_request_body_bytes",
            "max_unread_tokens",
            "responses_store_max_entries",
            "responses_store_max_bytes",
        ):
            _not_negative(name, getattr(self, name))
        if self.max_prompt_bytes is not None:
            _not_negative("max_prompt_bytes", self.max_prompt_bytes)
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}.")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}.")
        if not self.responses_store_max_age_s > 0:
            raise ValueError(
                f"responses_store_max_age_s must be > 0, got {self.responses_store_max_age_s}."
            )

    def prompt_bytes_limit(self, max_model_len: int) -> int:
        """The prompt-size limit in bytes (0: none)."""
        if self.max_prompt_bytes is None:
            return PROMPT_BYTES_PER_TOKEN * max_model_len
        return self.max_prompt_bytes


def _not_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0: no limit), got {value}.")
