"""ApiKey: the optional key of the public APIs, compared in constant time.

HTTP (`Authorization: Bearer KEY` on /v1; the Anthropic Messages routes also take
Anthropic's `x-api-key: KEY`) and gRPC (`authorization: Bearer KEY` metadata on every
Generation call) check the same key the same way: hmac.compare_digest over the whole
header value, so the time a comparison takes says nothing about how much of a guessed key
was right.
"""

from __future__ import annotations

import hmac

__all__ = ["ApiKey", "AuthenticationError"]


class AuthenticationError(PermissionError):
    """A missing or wrong API key (HTTP 401, gRPC UNAUTHENTICATED)."""


class ApiKey:
    def __init__(self, key: str | None) -> None:
        self._key = key.encode() if key else None
        self._expected = b"Bearer " + self._key if self._key else None

    @property
    def required(self) -> bool:
        return self._expected is not None

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an Authorization header (or metadata) value carries the key."""
        return self._matches(authorization, self._expected)

    def allows_x_api_key(self, value: str | bytes | None) -> bool:
        """Whether an `x-api-key` header value (the bare key, Anthropic's header) is the key."""
        return self._matches(value, self._key)

    def check(self, authorization: str | bytes | None) -> None:
        if not self.allows(authorization):
            raise AuthenticationError("missing or invalid API key (authorization: Bearer KEY).")

    @staticmethod
    def _matches(value: str | bytes | None, expected: bytes | None) -> bool:
        if expected is None:
            return True
        if isinstance(value, str):
            value = value.encode()
        return hmac.compare_digest(value or b"", expected)
