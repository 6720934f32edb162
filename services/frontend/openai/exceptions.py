"""The OpenAI server's own exceptions: a bad parameter, an unknown model, a wrong API key.

They sit apart from errors.py (the mapping to HTTP statuses) so the request models in
protocol.py can raise them while errors.py reads the request models' field names.
"""

from __future__ import annotations

__all__ = ["AuthenticationError", "InvalidRequestError", "ModelNotFoundError"]


class InvalidRequestError(ValueError):
    """A bad request parameter, with the parameter's name (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(LookupError):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")


class AuthenticationError(PermissionError):
    pass
