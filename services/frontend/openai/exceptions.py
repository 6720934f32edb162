"""The OpenAI server's own exceptions: a bad parameter, an unknown model or stored response,
a wrong API key.

They sit apart from errors.py (the mapping to HTTP statuses) so the request models in
protocol.py can raise them while errors.py reads the request models' field names.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from services.frontend.api_key import AuthenticationError  # shared with the gRPC API

__all__ = [
    "AuthenticationError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "RequestBodyTooLargeError",
    "ResponseNotFoundError",
]


class InvalidRequestError(ValueError):
    """A bad request parameter, with the parameter's name (HTTP 400) and OpenAI's error
    code (invalid_value, or context_length_exceeded for a prompt over the context)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotFoundError(LookupError):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")


class ResponseNotFoundError(LookupError):
    """A Responses API id that is not stored (never, not any more, or store=false): 404.
    `param` is the field that named it: previous_response_id, or None for the URL."""

    def __init__(self, response_id: str, param: str | None = None) -> None:
        what = "Previous response" if param == "previous_response_id" else "Response"
        super().__init__(f"{what} with id '{response_id}' not found.")
        self.param = param

    @property
    def code(self) -> str:
        if self.param == "previous_response_id":
            return "previous_response_not_found"
        return "response_not_found"


class RequestBodyTooLargeError(HTTPException):
    """An HTTP request body over max_request_body_bytes (HTTP 400). An HTTPException, so
    FastAPI passes it on unchanged when it comes out of reading the body."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            400,
            f"the request body is larger than the limit of {limit} bytes "
            "(max_request_body_bytes, --max-request-body-bytes).",
        )

    def __str__(self) -> str:
        return str(self.detail)
