"""InprocEngineCoreClient: the frontend's EngineCoreClient as direct calls in one process.

The in-process transport of the frontend -> engine core hop: the Frontend
(services/frontend) knows only the EngineCoreClient interface, the AsyncEngineCore
(services/scheduler) knows only client ids; this module, on the side that wires them
together, joins the two. The engine core's EngineDeadError becomes EngineUnavailableError,
as a broken gRPC stream does on the other transport; its refusals
(services/common/engine_errors.py) pass as they are. Readiness is the
engine core's own `ready` flag (false while it reconnects to lost workers); a dead
engine loop never comes back, so `reconnect` then raises.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

from services.common.engine_errors import EngineUnavailableError
from services.common.engine_output import EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.common.kv_events import KvEventBatch
from services.scheduler.async_engine_core import AsyncEngineCore, EngineDeadError

__all__ = ["InprocEngineCoreClient"]


@contextmanager
def _engine_errors() -> Iterator[None]:
    try:
        yield
    except EngineDeadError as exc:
        raise EngineUnavailableError(str(exc)) from exc


class InprocEngineCoreClient:
    """Direct calls into an AsyncEngineCore living in this process (create inside its loop)."""

    def __init__(self, core: AsyncEngineCore) -> None:
        self.core = core
        self.on_ready_change: Callable[[bool], None] | None = None
        with _engine_errors():
            self.client_id = core.connect()
        self._hear_readiness()

    def _hear_readiness(self) -> None:
        """Chain onto the engine core's readiness callback (others may listen too)."""
        previous = self.core.on_ready

        async def on_ready(ready: bool) -> None:
            if previous is not None:
                await previous(ready)
            if self.on_ready_change is not None:
                self.on_ready_change(ready)

        self.core.on_ready = on_ready

    @property
    def ready(self) -> bool:
        return self.core.ready and self.core.dead_error is None

    async def reconnect(self) -> None:
        """A new client id (the old one's requests are aborted); raises when the loop died."""
        await self.core.disconnect(self.client_id)
        with _engine_errors():
            self.client_id = self.core.connect()

    async def add_request(self, request: EngineCoreRequest) -> None:
        with _engine_errors():
            await self.core.add_request(self.client_id, request)

    async def abort(self, request_ids: list[str]) -> None:
        await self.core.abort(request_ids)

    async def next_outputs(self) -> EngineCoreOutputs:
        with _engine_errors():
            return await self.core.outputs(self.client_id)

    async def stats(self) -> SchedulerStats:
        return self.core.stats()

    async def engine_stats(self) -> dict[str, SchedulerStats]:
        return {"0": self.core.stats()}

    def routing_counts(self) -> dict[tuple[str, str], int]:
        return {}  # one engine core: nothing is routed

    def release(self, request_id: str) -> None:
        """Nothing to forget: one engine core owns every request."""

    async def watch_kv_events(self) -> AsyncIterator[KvEventBatch]:
        """The engine core's prefix-cache snapshot, then its changes, until it stops."""
        queue = await self.core.subscribe_kv_events()
        try:
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            self.core.unsubscribe_kv_events(queue)
        raise EngineUnavailableError("the engine core stopped")

    async def close(self) -> None:
        await self.core.disconnect(self.client_id)
