"""Anthropic's error bodies, and the mapping from the server's exceptions to them.

The Messages routes fail with the same exceptions as the OpenAI routes (one place decides
what a failure is: services/frontend/openai/errors.py, whose status and message this
reuses); only the shape differs: `{"type": "error", "error": {"type", "message"}}`, with
Anthropic's types: invalid_request_error (400, and the other 4xx), authentication_error
(401), not_found_error (404), request_too_large (413), overloaded_error (529: the server is
overloaded or its engine is away, both worth a retry), api_error (500 and other 5xx).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from services.common.engine_errors import EngineOverloadedError, EngineUnavailableError
from services.frontend.openai.errors import OverloadedError, to_openai_error
from services.frontend.openai.exceptions import RequestBodyTooLargeError

__all__ = ["AnthropicError", "to_anthropic_error"]

OVERLOADED_STATUS = 529  # Anthropic's status for "try again shortly"

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED_STATUS: "overloaded_error",
}
# The OpenAI routes name a request field first ("stop has 9 stop strings"); these are the
# internal chat request's names of fields the Messages API calls otherwise.
_FIELD_NAMES = {"stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens"}


@dataclass(frozen=True)
class AnthropicError:
    status: int
    type: str
    message: str
    headers: dict[str, str] | None = None

    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The stream's error event (the status line went out with the first event)."""
        return f"event: error\ndata: {json.dumps(self.body())}\n\n"


def to_anthropic_error(exc: BaseException) -> AnthropicError:
    """What a Messages client sees for `exc`: the OpenAI routes' status and message, in
    Anthropic's shape (and with its statuses for a body too large and for overload)."""
    if isinstance(exc, RequestBodyTooLargeError):
        return AnthropicError(413, "request_too_large", str(exc))
    error = to_openai_error(exc)
    status = error.status
    if isinstance(exc, OverloadedError | EngineOverloadedError | EngineUnavailableError):
        status = OVERLOADED_STATUS
    kind = _TYPE_OF_STATUS.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return AnthropicError(status, kind, _with_field_names(error.message), error.headers)


def _with_field_names(message: str) -> str:
    head, space, rest = message.partition(" ")
    name = _FIELD_NAMES.get(head.rstrip(":"))
    if name is None:
        return message
    return name + head[len(head.rstrip(":")) :] + space + rest
