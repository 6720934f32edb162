"""Client channels to pagestream services, and waiting until a service reports SERVING."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.tls import PLAINTEXT, TlsConfig

logger = logging.getLogger(__name__)

# Look for a server that went away every second at most (gRPC's default backoff grows to
# two minutes, far too slow to notice a restarted scheduler, or one still starting).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

_SERVING = health_pb2.HealthCheckResponse.SERVING
_RETRY_S = 0.2


def aio_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel (create it inside the running loop); TLS when `tls` is set."""
    credentials = (tls or PLAINTEXT).channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def sync_channel(
    address: str, tls: TlsConfig | None = None, options: list | None = None
) -> grpc.Channel:
    """A blocking channel, for callers on their own threads (the engine core's step);
    `options` come on top of the shared ones (e.g. RECONNECT_OPTIONS)."""
    options = [*CHANNEL_OPTIONS, *(options or [])]
    credentials = (tls or PLAINTEXT).channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def _not_ready(address: str, service: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"{service or 'the server'} at {address} is not SERVING after {timeout_s}s")


async def wait_until_serving(
    channel: grpc.aio.Channel, service: str, timeout_s: float, address: str = ""
) -> None:
    """Return once `service` reports SERVING; TimeoutError after timeout_s.

    Waits for the server to come up (wait_for_ready) and watches its health, so a server
    that is still loading its model is waited for, not treated as failed.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=service)
    while (left := deadline - time.monotonic()) > 0:
        call = stub.Watch(request, timeout=left, wait_for_ready=True)
        try:
            async for response in call:
                if response.status == _SERVING:
                    return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                break
            logger.debug("health watch of %s failed (%s); retrying", address, exc.code())
        finally:
            call.cancel()
        await asyncio.sleep(min(_RETRY_S, max(deadline - time.monotonic(), 0)))
    raise _not_ready(address, service, timeout_s)


def wait_until_serving_sync(
    channel: grpc.Channel, service: str, timeout_s: float, address: str = ""
) -> None:
    """The blocking form of wait_until_serving, for threads."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=service)
    while (left := deadline - time.monotonic()) > 0:
        responses = stub.Watch(request, timeout=left, wait_for_ready=True)
        try:
            for response in responses:
                if response.status == _SERVING:
                    return
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                break
            logger.debug("health watch of %s failed (%s); retrying", address, exc.code())
        finally:
            responses.cancel()
        time.sleep(min(_RETRY_S, max(deadline - time.monotonic(), 0)))
    raise _not_ready(address, service, timeout_s)
