"""FrontendConfig: the frontend's protections, all checked before the engine sees a request.

Sizes of prompts, messages, stop strings, tools, logit_bias and gRPC messages
(request_limits.py), whether a request may bring its own chat template (then rendered in a
bounded child process), the request timeout, the unread-output bound (output_queue.py) and
the Responses store's bounds. The defaults let any request that fits the model's context
through while a stalled or hostile client costs a bounded amount. Also how replies are
read: the reasoning parser and the chat template's default variables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.flags import flag
from services.frontend.reasoning import REASONING_PARSERS

MIB = 1024 * 1024
# A token is rarely more than a few bytes of text (English ~4, CJK ~3 per character, long
# whitespace or punctuation runs up to ~16); 32 bytes per token of context lets any prompt
# through that could fit, and bounds the tokenizer's work (on the event loop) per request.
PROMPT_BYTES_PER_TOKEN = 32
# Images per prompt when --limit-mm-per-prompt leaves it unset. Each image costs the frontend
# its decoded pixels (up to --max-image-pixels x 3 bytes) and the engine an encoder run and
# hundreds of prompt tokens; 4 covers an image chat or a comparison of a few pictures.
DEFAULT_IMAGE_LIMIT = 4
MODALITIES = ("image",)


@dataclass(frozen=True)
class FrontendConfig:
    max_prompt_bytes: int | None = flag(
        None,
        "refuse (400) text prompts, or chat messages together, over this many UTF-8 bytes, "
        "before tokenizing (default: 32 x the context length; 0: no limit)",
    )
    max_messages: int = flag(1024, "chat messages per request (0: any)")
    max_n: int = flag(128, "sequences (n, beam width) per prompt, as OpenAI caps n")
    max_prompts: int = flag(
        2048,
        "prompts in one request: a completions prompt array, or the inputs (pairs) of "
        "embeddings, scores, rerank and classify (OpenAI's embeddings limit)",
    )
    max_sequences: int = flag(
        4096, "prompts x n in one request: the sequences it may start at once"
    )
    max_stop_sequences: int = flag(4, "stop strings per request (OpenAI's and TGI's limit; 0: any)")
    max_stop_sequence_chars: int = flag(256, "characters in one stop string (0: any length)")
    max_stop_token_ids: int = flag(1024, "stop_token_ids per request (0: any)")
    max_logit_bias: int = flag(300, "logit_bias entries per request (OpenAI's limit; 0: any)")
    max_tools: int = flag(128, "tool definitions per request (OpenAI's limit; 0: any)")
    max_request_body_bytes: int = flag(
        16 * MIB,
        "refuse HTTP request bodies (400) and public gRPC messages (RESOURCE_EXHAUSTED) over "
        "this size (0: HTTP unbounded, gRPC the internal services' 256 MiB)",
    )
    max_concurrent_streams: int = flag(
        100,
        "concurrent calls (HTTP/2 streams) on one connection to the public gRPC API; "
        "more wait for a free one (0: grpc's default, unbounded)",
    )
    trust_request_chat_template: bool = flag(
        False,
        "accept a chat_template in requests (HTTP chat / tokenize, gRPC chat); off, such "
        "requests get 400: a template is a program the server would run",
    )
    max_chat_template_bytes: int = flag(
        256 * 1024, "a request's own chat_template, at most this many bytes (when trusted)"
    )
    chat_template_timeout_s: float = flag(
        5.0,
        "a request's own chat template gets this many seconds to render (in a child "
        "process, killed past it); waiting for the renderer counts",
        name="chat-template-timeout",
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
    reasoning_parser: str | None = flag(
        None,
        "the model's thinking format: chat replies carry the thinking in reasoning_content "
        "(OpenAI), thinking blocks (Anthropic), reasoning_text (gRPC), apart from the answer",
        choices=sorted(REASONING_PARSERS),
    )
    limit_mm_per_prompt: str | None = flag(
        None,
        "items of each modality one prompt may carry, a JSON object ('{\"image\": 4}'); more "
        f"is a 400 (default: {DEFAULT_IMAGE_LIMIT} images, which bounds a request's decoding "
        "memory and encoder work; 0: no images)",
    )
    max_image_bytes: int = flag(
        20 * MIB,
        "an image's encoded size (a data URL's, a file's, a download's), at most (OpenAI's "
        "per-image limit; 0: no limit)",
    )
    max_image_pixels: int = flag(
        4096 * 4096,
        "an image's width x height, at most, read from its header before it is decoded "
        "(decompression bombs; 0: PIL's own bound)",
    )
    allowed_local_media_path: str | None = flag(
        None,
        "image_url may name files (file:// or an absolute path) under this folder; default: "
        "no files are read",
    )
    allowed_media_domains: tuple[str, ...] = flag(
        (),
        "image_url may be an http(s) URL on these hosts (redirects too); default: none, a "
        "server fetches nothing a client names",
    )
    media_fetch_timeout_s: float = flag(
        5.0,
        "an http(s) image download gets this many seconds, whole",
        name="media-fetch-timeout",
    )
    default_chat_template_kwargs: str | None = flag(
        None,
        "variables for the chat template, a JSON object ('{\"enable_thinking\": false}'); "
        "a request's chat_template_kwargs override them",
    )

    def __post_init__(self) -> None:
        for name in (
            "max_messages",
            "max_stop_sequences",
            "max_stop_sequence_chars",
            "max_stop_token_ids",
            "max_logit_bias",
            "max_tools",
            "max_concurrent_streams",
            "max_chat_template_bytes",
            "max_request_body_bytes",
            "max_unread_tokens",
            "responses_store_max_entries",
            "responses_store_max_bytes",
            "max_image_bytes",
            "max_image_pixels",
        ):
            _not_negative(name, getattr(self, name))
        if self.max_prompt_bytes is not None:
            _not_negative("max_prompt_bytes", self.max_prompt_bytes)
        for name in ("max_n", "max_prompts", "max_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not self.chat_template_timeout_s > 0:
            raise ValueError(
                f"chat_template_timeout_s must be > 0, got {self.chat_template_timeout_s}."
            )
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}.")
        _ = self.chat_template_kwargs  # a bad JSON object fails at start
        _ = self.image_limit
        if not self.media_fetch_timeout_s > 0:
            raise ValueError(
                f"media_fetch_timeout_s must be > 0, got {self.media_fetch_timeout_s}."
            )
        if not self.responses_store_max_age_s > 0:
            raise ValueError(
                f"responses_store_max_age_s must be > 0, got {self.responses_store_max_age_s}."
            )

    @property
    def chat_template_kwargs(self) -> dict:
        """--default-chat-template-kwargs as a dict."""
        if self.default_chat_template_kwargs is None:
            return {}
        try:
            kwargs = json.loads(self.default_chat_template_kwargs)
        except ValueError as exc:
            raise ValueError(f"default_chat_template_kwargs is not JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("default_chat_template_kwargs must be a JSON object.")
        return kwargs

    @property
    def image_limit(self) -> int:
        """Images per prompt (--limit-mm-per-prompt, a JSON object or, in Python, a dict)."""
        value = self.limit_mm_per_prompt
        if value is None:
            return DEFAULT_IMAGE_LIMIT
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"limit_mm_per_prompt is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("limit_mm_per_prompt must be a JSON object ('{\"image\": 4}').")
        for key, count in value.items():
            if key not in MODALITIES:
                raise ValueError(
                    f"limit_mm_per_prompt: {key!r} is not a modality this server takes "
                    f"({', '.join(MODALITIES)})."
                )
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"limit_mm_per_prompt: {key} must be an integer >= 0.")
        return value.get("image", DEFAULT_IMAGE_LIMIT)

    def prompt_bytes_limit(self, max_model_len: int) -> int:
        """The prompt-size limit in bytes (0: none)."""
        if self.max_prompt_bytes is None:
            return PROMPT_BYTES_PER_TOKEN * max_model_len
        return self.max_prompt_bytes


def _not_negative(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0: no limit), got {value}.")
