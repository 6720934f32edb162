"""EngineCoreHealth: the frontend's view of whether its engine core (the scheduler) serves.

A task watches the scheduler's `grpc.health.v1` status for the EngineCore service: SERVING
once its workers are there, NOT_SERVING while it reconnects to them, and no answer at all
while the scheduler itself is away. The watch is re-opened with backoff whenever it breaks,
so the frontend learns within about a second that a restarted scheduler serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.backoff import Backoff

logger = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
# Between broken watches; short, since the watch itself waits for the server to be ready.
BACKOFF = Backoff((0.1, 0.25, 0.5, 1.0))


class EngineCoreHealth:
    """`serving` as last reported; `on_change(serving)` hears every change."""

    def __init__(self, channel: grpc.aio.Channel, service: str, address: str) -> None:
        self.service = service
        self.address = address
        self.serving = False
        self.on_change: Callable[[bool], None] | None = None
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._serving_event = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self, serving: bool) -> None:
        """Start watching (from the running loop), starting from a known status."""
        self._set(serving)
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def wait_serving(self) -> None:
        await self._serving_event.wait()

    async def confirm_serving(self, timeout_s: float = 5.0) -> bool:
        """Ask the engine core now (the watch may not yet have seen it go away): True
        when it answers SERVING; anything else also updates `serving`."""
        request = health_pb2.HealthCheckRequest(service=self.service)
        try:
            response = await self._stub.Check(request, wait_for_ready=True, timeout=timeout_s)
        except grpc.RpcError:
            self._set(False)
            return False
        self._set(response.status == _SERVING)
        return self.serving

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._serving_event.set()  # wake the waiters; they find the client closed

    async def _watch(self) -> None:
        request = health_pb2.HealthCheckRequest(service=self.service)
        attempt = 0
        while True:
            call = self._stub.Watch(request, wait_for_ready=True)
            try:
                async for response in call:
                    attempt = 0
                    self._set(response.status == _SERVING)
            except grpc.RpcError as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else exc
                logger.debug("health watch of %s broke (%s); watching again", self.address, code)
            finally:
                call.cancel()
            self._set(False)
            await asyncio.sleep(BACKOFF.delay(attempt))
            attempt += 1

    def _set(self, serving: bool) -> None:
        if serving:
            self._serving_event.set()
        else:
            self._serving_event.clear()
        if serving == self.serving:
            return
        self.serving = serving
        logger.info("engine core at %s: %s", self.address, "SERVING" if serving else "NOT_SERVING")
        if self.on_change is not None:
            self.on_change(serving)
