"""Run an ASGI app under uvicorn inside the current event loop (the engine's loop).

The socket is bound here, so a taken port raises OSError to the caller instead of uvicorn's
sys.exit, and port 0 gives a free port, reported on the handle. Signals are left to the
caller (the CLI), which calls `stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

logger = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handlers, reporting when it is listening."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self.listening.set()


class HttpServer:
    """A running server: `host`, `port` (the bound one), `url`, `stop()`."""

    def __init__(self, server: _EmbeddedServer, task: asyncio.Task, sock: socket.socket) -> None:
        self._server = server
        self._task = task
        self._socket = sock
        self.host, self.port = sock.getsockname()[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def wait(self) -> None:
        """Until the server stops (stop() from elsewhere, or a failure)."""
        await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (up to the graceful timeout), close."""
        self._server.should_exit = True
        try:
            await self._task
        finally:
            self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def serve_http(
    app,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "warning",
    timeout_graceful_shutdown: float = 5.0,
) -> HttpServer:
    """Start serving `app` on host:port (0: any free port) as a task on this loop."""
    sock = _bind(host, port)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=timeout_graceful_shutdown,
        access_log=False,
    )
    server = _EmbeddedServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    listening = asyncio.ensure_future(server.listening.wait())
    await asyncio.wait({task, listening}, return_when=asyncio.FIRST_COMPLETED)
    if not listening.done():
        listening.cancel()
        sock.close()
        await task  # raises what stopped it
        raise RuntimeError("the HTTP server stopped before it started")
    handle = HttpServer(server, task, sock)
    logger.info("OpenAI-compatible server listening on %s", handle.url)
    return handle
