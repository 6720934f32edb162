"""AsyncEngineCore: the engine core's step loop as an asyncio actor with many clients.

Clients (frontends) connect and get an id; their add/abort calls land between steps; each
step's outputs are routed to the queue of the client that owns the request. The step
itself (the executor's forward pass) runs on one worker thread, never on the event loop.
With a batch queue deeper than one (async scheduling, pipeline parallelism) a step may
submit a plan and return before any output: the loop runs while the core has work, and
that counts plans in flight. A step whose executor failed raises, which ends the loop.
The gRPC EngineCore servicer wraps exactly these methods, one Connect stream per client.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor

from services.common.engine_output import EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.scheduler.engine_core import EngineCore
from services.scheduler.request import Request

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop failed; no request can be served any more."""


class AsyncEngineCore:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._queues: dict[int, asyncio.Queue] = {}
        self._client_ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagestream-step")
        self.dead_error: BaseException | None = None

    # ---- clients -------------------------------------------------------------------
    def connect(self) -> int:
        """A new client; its outputs arrive through outputs(client_id)."""
        self._check_alive()
        client_id = next(self._client_ids)
        self._queues[client_id] = asyncio.Queue()
        self._ensure_loop()
        return client_id

    async def disconnect(self, client_id: int) -> None:
        """A client that goes away aborts every request it still has."""
        self._queues.pop(client_id, None)
        requests = self.core.scheduler.requests.values()
        owned = sorted({r.group_id for r in requests if r.client_id == client_id})
        if owned:
            await self.abort(owned)

    async def add_request(self, client_id: int, request: EngineCoreRequest) -> None:
        """Admit a request (RequestRejectedError says why not)."""
        self._check_alive()
        engine_request = Request.from_engine_request(request, self.core.scheduler.block_size)
        engine_request.client_id = client_id
        async with self._lock:
            self.core.add_request(engine_request)
        self._wakeup.set()

    async def abort(self, request_ids: list[str]) -> None:
        async with self._lock:
            self.core.abort_requests(request_ids)
        self._wakeup.set()

    async def outputs(self, client_id: int) -> EngineCoreOutputs:
        """The next batch for this client (raises EngineDeadError if the loop failed)."""
        item = await self._queues[client_id].get()
        if isinstance(item, BaseException):
            raise EngineDeadError(f"the engine loop failed: {item!r}") from item
        return item

    def stats(self) -> SchedulerStats:
        return self.core.scheduler.get_stats()

    # ---- the loop ------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.dead_error!r}")

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wakeup.clear()
                if not self.core.has_work():
                    await self._wakeup.wait()
                    continue
                async with self._lock:
                    batches = await loop.run_in_executor(self._thread, self.core.step)
                self._route(batches)
                await asyncio.sleep(0)  # let adds and aborts in between steps
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("engine core loop failed")
            self.dead_error = exc
            for queue in self._queues.values():
                queue.put_nowait(exc)

    def _route(self, batches: dict[int, EngineCoreOutputs]) -> None:
        for client_id, batch in batches.items():
            queue = self._queues.get(client_id)
            if queue is not None:
                queue.put_nowait(batch)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self._thread.shutdown, wait=True)
