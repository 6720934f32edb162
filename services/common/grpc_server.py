"""GrpcServer: the plumbing every pagestream gRPC service shares.

One grpc.aio server per role, with message-size limits that fit large plans and prompt
logprobs, keepalive settings that survive minutes-long prefills, `grpc.health.v1` Health
(NOT_SERVING until the role says it is ready; NOT_SERVING again first thing on shutdown,
then the server drains for `grace` seconds) and server reflection for the role's services.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.tls import PLAINTEXT, TlsConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Pings every 30 s keep idle connections (and NATs) alive while a long prefill runs.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = [
    *MESSAGE_OPTIONS,
    *KEEPALIVE_OPTIONS,
    # Accept the clients' keepalive pings (every 30 s) without calling them abusive.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    # Never share a port with another server: a second bind of a busy port must fail.
    ("grpc.so_reuseport", 0),
]
CHANNEL_OPTIONS = [*MESSAGE_OPTIONS, *KEEPALIVE_OPTIONS]


def public_server_options(max_message_bytes: int, max_concurrent_streams: int) -> list:
    """A public server's options: the internal ones with messages bounded like the HTTP
    body (a client's message is held whole in memory before any check runs) and the
    concurrent calls one connection may open bounded (HTTP/2 streams; more wait)."""
    options = dict(SERVER_OPTIONS)
    if max_message_bytes:
        options["grpc.max_receive_message_length"] = max_message_bytes
    if max_concurrent_streams:
        options["grpc.max_concurrent_streams"] = max_concurrent_streams
    return list(options.items())


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICE_NAME = health.SERVICE_NAME


def format_address(host: str, port: int) -> str:
    """host:port, with IPv6 literals in brackets; a `unix:PATH` host is a unix socket
    (the port does not apply)."""
    if host.startswith("unix:"):
        return host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class GrpcServer:
    """A started server: its bound port, its health and a graceful stop."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        service_names: Sequence[str],
        host: str,
        port: int,
    ) -> None:
        self.server = server
        self.health = health_servicer
        self.service_names = list(service_names)
        self.host = host
        self.port = port
        # The role's servicer, for in-process access (tests, the embedded deployment).
        self.servicer: Any = None
        self._cleanups: list[Callable[[], Awaitable[None]]] = []
        self._stopped = False

    @property
    def address(self) -> str:
        """Where clients connect (the wildcard host becomes loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(self.host, self.host)
        return format_address(host, self.port)

    async def set_serving(self, serving: bool = True) -> None:
        """Health of the whole server ("") and of every service it carries."""
        status = _SERVING if serving else _NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    def add_cleanup(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        """Run after the server has drained, in the order they were added."""
        self._cleanups.append(cleanup)

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING first, then let in-flight calls finish for `grace` seconds."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for cleanup in self._cleanups:
            try:
                await cleanup()
            except Exception:
                logger.exception("cleanup after server stop failed")

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    tls: TlsConfig | None = None,
    require_client_auth: bool = False,
    options: Sequence[tuple[str, Any]] = SERVER_OPTIONS,
) -> GrpcServer:
    """Start a server with the role's servicers (added by `register`), health and reflection.

    Health starts NOT_SERVING; call `set_serving()` when the role is ready. Port 0 picks
    a free port: the bound one is `GrpcServer.port`. With `tls` carrying a certificate the
    port speaks TLS; `require_client_auth` (internal services) asks for mutual TLS when
    `tls` has a CA. `options`: the internal services' SERVER_OPTIONS, or a public
    server's (public_server_options).
    """
    server = grpc.aio.server(options=list(options))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_names):
        await health_servicer.set(name, _NOT_SERVING)
    reflection.enable_server_reflection(
        [*service_names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    credentials = (tls or PLAINTEXT).server_credentials(require_client_auth)
    try:
        if credentials is None:
            bound = server.add_insecure_port(format_address(host, port))
        else:
            bound = server.add_secure_port(format_address(host, port), credentials)
    except RuntimeError as exc:
        raise OSError(f"cannot bind {format_address(host, port)}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind {format_address(host, port)}")
    await server.start()
    logger.info("serving %s on %s", ", ".join(service_names), format_address(host, bound))
    return GrpcServer(server, health_servicer, service_names, host, bound)


class Stoppable(Protocol):
    async def wait_for_termination(self) -> None: ...

    async def stop(self, grace: float | None) -> None: ...


async def serve_forever(server: Stoppable, grace: float = 5.0) -> None:
    """Wait for SIGINT/SIGTERM (or the server's end), then stop gracefully.

    Takes a GrpcServer or any handle with the same two methods (e.g. FrontendServer).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    ended = asyncio.ensure_future(server.wait_for_termination())
    signalled = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({ended, signalled}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        signalled.cancel()
        logger.info("shutting down (grace %.1fs)", grace)
        await server.stop(grace)
        ended.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
