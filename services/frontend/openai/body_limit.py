"""BodyLimitMiddleware: refuse HTTP request bodies over max_request_body_bytes.

A pure ASGI middleware: a Content-Length over the limit is answered with a 400 before any
of the body is read; a body sent without one (chunked) is counted as it arrives and the
read fails with RequestBodyTooLargeError (400, through the app's error mapping) once it
passes the limit. Nothing past the limit is ever buffered.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse, Response

from services.frontend.openai.errors import to_openai_error
from services.frontend.openai.exceptions import RequestBodyTooLargeError


def _openai_refusal(_path: str, exc: Exception) -> Response:
    error = to_openai_error(exc)
    return JSONResponse(error.body(), status_code=error.status)


class BodyLimitMiddleware:
    """`refuse(path, exc)`: the response for a refused body (the app's error shape for
    that path; OpenAI's by default)."""

    def __init__(
        self, app, max_bytes: int, refuse: Callable[[str, Exception], Response] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.refuse = refuse or _openai_refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        if _content_length(scope) > self.max_bytes:
            response = self.refuse(scope["path"], RequestBodyTooLargeError(self.max_bytes))
            await response(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive):
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestBodyTooLargeError(self.max_bytes)
            return message

        return counted


def _content_length(scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
