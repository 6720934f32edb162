"""OpenAI error bodies and the one mapping from exceptions to HTTP statuses.

Every failure leaves the server as `{"error": {"message", "type", "param", "code"}}`:
ValueError (bad input, engine rejections, a limit exceeded) -> 400 naming the field,
unknown model or stored response -> 404, missing or wrong API key -> 401, a client that
stopped reading its stream -> 408, overload -> 429 with `Retry-After`, engine gone -> 503,
the server's request timeout -> 504. Request validation errors from pydantic (wrong types,
malformed JSON) are 400 too, never 422 or 500.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from http import HTTPStatus

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.engine_errors import EngineOverloadedError, EngineUnavailableError
from services.common.grpc_errors import OverloadedError
from services.frontend.frontend import RequestTimeoutError
from services.frontend.openai import protocol
from services.frontend.openai.exceptions import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestBodyTooLargeError,
    ResponseNotFoundError,
)
from services.frontend.output_queue import SlowConsumerError

logger = logging.getLogger(__name__)
__all__ = [  # the exceptions are re-exported: one import for the serving modules
    "AuthenticationError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "OpenAIError",
    "OverloadedError",  # the shared one (gRPC RESOURCE_EXHAUSTED), re-exported
    "ResponseNotFoundError",
    "to_openai_error",
]
RETRY_AFTER_S = 1  # what an overloaded server asks clients to wait before retrying


@dataclass(frozen=True)
class OpenAIError:
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# A ValueError's message starts with the field it is about ("temperature must be in ...").
_LEADING_NAME = re.compile(r"^([a-z][a-z0-9_]*)\b")


@functools.cache
def _known_params() -> frozenset[str]:
    """Every request field name (a ValueError's leading word is a parameter only if listed)."""
    models = (protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.TokenizeRequest)
    return frozenset(name for model in models for name in model.model_fields) | {"prompt_token_ids"}


def _param_of(exc: ValueError) -> str | None:
    param = getattr(exc, "param", None)
    if param is not None:
        return param
    match = _LEADING_NAME.match(str(exc))
    if match and match.group(1) in _known_params():
        return "prompt" if match.group(1) == "prompt_token_ids" else match.group(1)
    return None


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return OpenAIError(
            400,
            "the request body is not valid JSON.",
            "invalid_request_error",
            None,
            "invalid_json",
        )
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = _format_loc(loc) or None
    message = first.get("msg", "invalid request")
    text = f"{param}: {message}" if param else f"request body: {message}"
    return OpenAIError(400, text, "invalid_request_error", param, "invalid_value")


def _format_loc(loc: list) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue  # pydantic's union-member labels, not field names
        else:
            text += f".{part}" if text else str(part)
    return text


def to_openai_error(exc: BaseException) -> OpenAIError:
    """The one mapping from what can go wrong to what the client sees."""
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc)
    if isinstance(exc, ModelNotFoundError):
        return OpenAIError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, ResponseNotFoundError):
        return OpenAIError(404, str(exc), "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, AuthenticationError):
        return OpenAIError(401, str(exc), "invalid_request_error", None, "invalid_api_key")
    if isinstance(exc, OverloadedError | EngineOverloadedError):
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        return OpenAIError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded", retry)
    if isinstance(exc, EngineUnavailableError):
        return OpenAIError(503, str(exc), "server_error", None, "engine_unavailable")
    if isinstance(exc, RequestTimeoutError):
        return OpenAIError(504, str(exc), "server_error", None, "request_timeout")
    if isinstance(exc, SlowConsumerError):
        return OpenAIError(408, str(exc), "invalid_request_error", None, "slow_consumer")
    if isinstance(exc, RequestBodyTooLargeError):
        return OpenAIError(400, str(exc), "invalid_request_error", None, "request_too_large")
    if isinstance(exc, ValueError):
        code = getattr(exc, "code", None) or "invalid_value"
        return OpenAIError(400, str(exc), "invalid_request_error", _param_of(exc), code)
    if isinstance(exc, StarletteHTTPException):
        status = HTTPStatus(exc.status_code)
        code = status.phrase.lower().replace(" ", "_")
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind, None, code)
    logger.error("unexpected error while serving a request", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}", "server_error", None, None)
