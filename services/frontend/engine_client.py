"""EngineCoreClient: how a frontend talks to the engine core, whatever carries it.

In one process the client calls the AsyncEngineCore directly; between processes the gRPC
client (services/frontend/grpc_engine_client.py) carries the same calls over
EngineCore.Connect.
"""

from __future__ import annotations

from typing import Protocol

from services.common.engine_output import EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.scheduler.async_engine_core import AsyncEngineCore


class EngineCoreClient(Protocol):
    async def add_request(self, request: EngineCoreRequest) -> None:
        """Admit; raises ValueError (naming the problem) when the engine core rejects it."""

    async def abort(self, request_ids: list[str]) -> None: ...

    async def next_outputs(self) -> EngineCoreOutputs:
        """The next step's outputs for this client's requests."""

    async def stats(self) -> SchedulerStats: ...

    async def close(self) -> None: ...


class InprocEngineCoreClient:
    """Direct calls into an AsyncEngineCore living in this process."""

    def __init__(self, core: AsyncEngineCore) -> None:
        self.core = core
        self.client_id = core.connect()

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self.core.add_request(self.client_id, request)

    async def abort(self, request_ids: list[str]) -> None:
        await self.core.abort(request_ids)

    async def next_outputs(self) -> EngineCoreOutputs:
        return await self.core.outputs(self.client_id)

    async def stats(self) -> SchedulerStats:
        return self.core.stats()

    async def close(self) -> None:
        await self.core.disconnect(self.client_id)
