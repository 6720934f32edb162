"""EngineCoreClient: how a frontend talks to the engine core, whatever carries it.

The Frontend knows only this interface. Two transports implement it: over gRPC
(services/frontend/grpc_engine_client.py, one EngineCore.Connect stream) and in-process
(pagestream/inproc_client.py, direct calls into the engine core's asyncio actor; it lives
with the code that wires the services together, so the frontend never imports the
scheduler's classes).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from services.common.engine_errors import EngineOverloadedError, EngineUnavailableError
from services.common.engine_output import EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.common.kv_events import KvEventBatch


def output_error(code: str | None, message: str) -> Exception:
    """The exception an engine-core output's error stands for (EngineCoreOutput.error_code)."""
    if code == "unavailable":
        return EngineUnavailableError(message)
    if code == "resource_exhausted":
        return EngineOverloadedError(message)
    if code == "internal":  # the engine's fault, not the request's (HTTP 500)
        return RuntimeError(message)
    return ValueError(message)


class EngineCoreClient(Protocol):
    # Set by the Frontend: called with the new value whenever `ready` changes.
    on_ready_change: Callable[[bool], None] | None

    @property
    def ready(self) -> bool:
        """The engine core can take work now (it reports serving: its workers are there)."""

    async def reconnect(self) -> None:
        """After next_outputs raised EngineUnavailableError: wait until the engine core is
        back and connect again (the client's requests were lost with the connection).
        Raises EngineUnavailableError when it can never come back or the client is closed."""

    async def add_request(self, request: EngineCoreRequest) -> None:
        """Admit; raises ValueError (naming the problem) when the engine core rejects it.

        Over gRPC a rejection arrives later, as an output with `error` set."""

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests (or whole groups, by their id); each still gets a final output."""

    async def next_outputs(self) -> EngineCoreOutputs:
        """The next step's outputs for this client's requests."""

    async def stats(self) -> SchedulerStats:
        """The scheduler's load and cache counters (summed over data-parallel replicas)."""

    async def engine_stats(self) -> dict[str, SchedulerStats]:
        """Per engine core (the `engine` label of the metrics): {"0": ...} unless
        data-parallel."""

    def routing_counts(self) -> dict[tuple[str, str], int]:
        """Requests per (engine, reason) a data-parallel router sent; empty otherwise."""

    def release(self, request_id: str) -> None:
        """The Frontend is done with this request (a router forgets which replica had it)."""

    def watch_kv_events(self) -> AsyncIterator[KvEventBatch]:
        """The engine core's prefix-cache snapshot, then its changes and load, step by step
        (what a data-parallel router routes by); raises EngineUnavailableError when the
        engine core goes away."""

    async def close(self) -> None:
        """Disconnect; the engine core aborts every request this client still has."""
