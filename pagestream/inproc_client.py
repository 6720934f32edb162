"""InprocEngineCoreClient: the frontend's EngineCoreClient as direct calls in one process.

The in-process transport of the frontend -> engine core hop: the Frontend
(services/frontend) knows only the EngineCoreClient interface, the AsyncEngineCore
(services/scheduler) knows only client ids; this module, on the side that wires them
together, joins the two. The engine core's EngineDeadError becomes the interface's
EngineUnavailableError, as a broken gRPC stream does on the other transport.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.common.engine_output import EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.frontend.engine_client import EngineUnavailableError
from services.scheduler.async_engine_core import AsyncEngineCore, EngineDeadError

__all__ = ["InprocEngineCoreClient"]


@contextmanager
def _engine_gone() -> Iterator[None]:
    try:
        yield
    except EngineDeadError as exc:
        raise EngineUnavailableError(str(exc)) from exc


class InprocEngineCoreClient:
    """Direct calls into an AsyncEngineCore living in this process (create inside its loop)."""

    def __init__(self, core: AsyncEngineCore) -> None:
        self.core = core
        with _engine_gone():
            self.client_id = core.connect()

    async def add_request(self, request: EngineCoreRequest) -> None:
        with _engine_gone():
            await self.core.add_request(self.client_id, request)

    async def abort(self, request_ids: list[str]) -> None:
        await self.core.abort(request_ids)

    async def next_outputs(self) -> EngineCoreOutputs:
        with _engine_gone():
            return await self.core.outputs(self.client_id)

    async def stats(self) -> SchedulerStats:
        return self.core.stats()

    async def close(self) -> None:
        await self.core.disconnect(self.client_id)
