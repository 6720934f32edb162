"""ApiKey: the optional bearer key of the public APIs, compared in constant time.

HTTP (`Authorization: Bearer KEY` on /v1) and gRPC (`authorization: Bearer KEY` metadata
on every Generation call) check the same key the same way: hmac.compare_digest over the
whole header value, so the time a comparison takes says nothing about how much of a
guessed key was right.
"""

from __future__ import annotations

import hmac

__all__ = ["ApiKey", "AuthenticationError"]


class AuthenticationError(PermissionError):
    """A missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""


class ApiKey:
    def __init__(self, key: str | None) -> None:
        self._expected = f"Bearer {key}".encode() if key else None

    @property
    def required(self) -> bool:
        return self._expected is not None

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an Authorization header (or metadata) value carries the key."""
        if self._expected is None:
            return True
        if isinstance(authorization, str):
            authorization = authorization.encode()
        return hmac.compare_digest(authorization or b"", self._expected)

    def check(self, authorization: str | bytes | None) -> None:
        if not self.allows(authorization):
            raise AuthenticationError("missing or invalid API key (authorization: Bearer KEY).")
