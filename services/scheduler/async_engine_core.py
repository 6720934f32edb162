"""AsyncEngineCore: the engine core's step loop as an asyncio actor with many clients.

Clients (frontends) connect and get an id; their adds and aborts land between steps (a
stream reader queues them without waiting, so those that arrive during a step share the
next); each step's outputs go to the queue of the client that owns the request. The step
runs on one worker thread, never on the event loop. With a batch queue deeper than one a
step may return before any output: the loop runs while the core has work, plans in flight
included. A step whose executor failed raises, which ends the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from services.common.backoff import Backoff
from services.common.engine_errors import EngineOverloadedError, EngineUnavailableError
from services.common.engine_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor.executor import WorkerStepError
from services.scheduler.kv_event_publisher import KvEventPublisher

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop failed; no request can be served any more."""


# Exceptions of a step that mean the workers are lost or out of step (recoverable by
# reconnecting); anything else is a bug in the engine core and kills the loop.
WORKER_LOSS = (ConnectionError, TimeoutError, WorkerStepError)
BACKOFF = Backoff((0.5, 1.0, 2.0, 4.0, 8.0))  # between failed rebuilds of the workers
IDLE_CHECK_S = 1.0  # how often an idle loop looks whether its workers are still there


class AsyncEngineCore:
    """`rebuild` (optional, blocking) makes a fresh EngineCore over reconnected workers;
    without it (or with `max_rebuilds` 0) a lost worker kills the loop, as does the failure
    of `max_rebuilds` attempts in a row (None: no limit: for workers someone else restarts).
    `on_ready(bool)` hears readiness changes."""

    def __init__(
        self,
        core: EngineCore,
        rebuild: Callable[[], EngineCore] | None = None,
        on_ready: Callable[[bool], Awaitable[None]] | None = None,
        max_rebuilds: int | None = None,
    ) -> None:
        self.core = core
        self.rebuild = rebuild
        self.max_rebuilds = max_rebuilds
        self.on_ready = on_ready
        self.ready = True
        self.lost_error: BaseException | None = None
        self._queues: dict[int, asyncio.Queue] = {}
        self._client_ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        # Queued adds (client id, request) and aborts (client id, request ids), in order.
        self._queued: deque[tuple[int, EngineCoreRequest | list[str]]] = deque()
        self._task: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagestream-step")
        self.dead_error: BaseException | None = None
        self.kv_events = KvEventPublisher(core.scheduler)

    # ---- clients -------------------------------------------------------------------
    def connect(self) -> int:
        """A new client; its outputs arrive through outputs(client_id)."""
        self._check_alive()
        client_id = next(self._client_ids)
        self._queues[client_id] = asyncio.Queue()
        self._ensure_loop()
        return client_id

    async def disconnect(self, client_id: int) -> None:
        """A client that goes away aborts every request it still has (what it queued and
        the loop has not taken yet is dropped)."""
        self._queues.pop(client_id, None)
        requests = self.core.scheduler.requests.values()
        owned = sorted({r.group_id for r in requests if r.client_id == client_id})
        if owned:
            await self.abort(owned)

    async def add_request(self, client_id: int, request: EngineCoreRequest) -> None:
        """Admit a request (RequestRejectedError says why not; EngineUnavailableError
        while the workers are away)."""
        self._check_alive()
        if not self.ready:
            raise self._unavailable()
        async with self._lock:
            self.core.add_request(request, client_id)
        self._wakeup.set()

    async def abort(self, request_ids: list[str]) -> None:
        async with self._lock:
            self.core.abort_requests(request_ids)
        self._wakeup.set()

    def queue_add(self, client_id: int, request: EngineCoreRequest) -> None:
        """Admit a request at the start of the next step, without waiting for it: a refused
        one comes back through outputs(client_id) as its output with finish_reason "error"
        (error_code: None for a bad request, "resource_exhausted", "unavailable", or
        "internal" when admitting it failed by the engine's fault)."""
        self._check_alive()
        if not self.ready:
            self._route({client_id: refusal(request.request_id, self._unavailable())})
            return
        self._queued.append((client_id, request))
        self._wakeup.set()

    def queue_abort(self, client_id: int, request_ids: list[str]) -> None:
        """Abort at the start of the next step, after everything queued before; only the
        client's own requests among `request_ids` end (ids are shared by all clients)."""
        self._check_alive()
        self._queued.append((client_id, list(request_ids)))
        self._wakeup.set()

    async def outputs(self, client_id: int) -> EngineCoreOutputs:
        """The next batch for this client (raises EngineDeadError if the loop failed)."""
        item = await self._queues[client_id].get()
        if isinstance(item, BaseException):
            raise EngineDeadError(f"the engine loop failed: {item!r}") from item
        return item

    def stats(self) -> SchedulerStats:
        return self.core.scheduler.get_stats()

    async def subscribe_kv_events(self) -> asyncio.Queue:
        """Prefix-cache changes and load (KvEventBatch; None ends): for routers."""
        async with self._lock:
            return self.kv_events.subscribe()

    def unsubscribe_kv_events(self, queue: asyncio.Queue) -> None:
        self.kv_events.unsubscribe(queue)

    # ---- the loop ------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.dead_error!r}")

    def _unavailable(self) -> EngineUnavailableError:
        return EngineUnavailableError(
            f"the workers are not available ({self.lost_error}); reconnecting"
        )

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while True:
                try:
                    await self._step_while_work()
                except WORKER_LOSS as exc:
                    if self.rebuild is None or self.max_rebuilds == 0:
                        raise
                    await self._recover(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("engine core loop failed")
            self.dead_error = exc
            self.kv_events.close()
            for queue in self._queues.values():
                queue.put_nowait(exc)

    async def _step_while_work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            self._take_queued()
            if not self.core.has_work():
                await self._wait_for_wakeup(IDLE_CHECK_S)
                self._raise_if_workers_failed()
                continue
            async with self._lock:
                batches = await loop.run_in_executor(self._thread, self.core.step)
                self.kv_events.publish()
            self._route(batches)
            await asyncio.sleep(0)  # let adds and aborts in between steps

    async def _wait_for_wakeup(self, timeout_s: float) -> None:
        """Until something is added or aborted, or `timeout_s` passed. Not asyncio.wait_for:
        before Python 3.12 it returns normally when cancelled just after the event was set
        (an add right before shutdown() left the loop running and shutdown() waiting)."""
        waiter = asyncio.ensure_future(self._wakeup.wait())
        try:
            await asyncio.wait([waiter], timeout=timeout_s)
        finally:
            waiter.cancel()

    def _take_queued(self) -> None:
        """Everything queued since the last step, in order: adds of clients still
        connected (a refusal is routed to its client), and aborts."""
        while self._queued:
            client_id, item = self._queued.popleft()
            if client_id not in self._queues:
                continue  # gone: disconnect() aborted what it had
            if isinstance(item, list):
                self.core.abort_requests(item, client_id)
                continue
            try:
                self.core.add_request(item, client_id)
            except (ValueError, EngineOverloadedError) as exc:
                self._route({client_id: refusal(item.request_id, exc)})
            except Exception as exc:  # a bug admitting it: this request fails, not the loop
                logger.exception("admitting %s failed", item.request_id)
                self._route({client_id: refusal(item.request_id, exc, "internal")})

    def _refuse_queued(self, exc: Exception) -> None:
        """The workers are lost: every queued add is refused with `exc`."""
        while self._queued:
            client_id, item = self._queued.popleft()
            if not isinstance(item, list):
                self._route({client_id: refusal(item.request_id, exc)})

    def _raise_if_workers_failed(self) -> None:
        """A rank lost while idle is noticed now, not at the next request."""
        failed = self.core.executor.failed
        if failed is not None:
            raise failed

    # ---- recovery ------------------------------------------------------------------
    async def _recover(self, exc: BaseException) -> None:
        """The workers are lost: end every request with an error, report not ready,
        reconnect with backoff, then serve again with a fresh cache."""
        logger.error("lost the workers (%s): failing requests and reconnecting", exc)
        self.ready, self.lost_error = False, exc
        await self._notify(False)
        async with self._lock:
            self._route(self._fail_everything(f"the workers failed: {exc}"))
            self._refuse_queued(self._unavailable())
        loop = asyncio.get_running_loop()
        for attempt in itertools.count():
            try:
                core = await loop.run_in_executor(self._thread, self.rebuild)
                break
            except Exception as err:
                if self.max_rebuilds is not None and attempt + 1 >= self.max_rebuilds:
                    raise  # the loop dies: whoever started this role starts it again
                delay = BACKOFF.delay(attempt)
                logger.warning(
                    "reconnect attempt %d failed (%s); next in %.1fs", attempt + 1, err, delay
                )
                await asyncio.sleep(delay)
        async with self._lock:
            self.core = core
            self.kv_events.attach(core.scheduler)
        self.ready, self.lost_error = True, None
        await self._notify(True)
        logger.info("reconnected to the workers: serving again")

    def _fail_everything(self, message: str) -> dict[int, EngineCoreOutputs]:
        """One error output per client request (n > 1 and beam groups once)."""
        groups = {(r.client_id, r.group_id) for r in self.core.scheduler.requests.values()}
        batches: dict[int, list[EngineCoreOutput]] = {}
        for client_id, group_id in sorted(groups, key=lambda g: (g[0] or 0, g[1])):
            output = EngineCoreOutput(
                group_id, [], finish_reason="error", error=message, error_code="unavailable"
            )
            batches.setdefault(client_id, []).append(output)
        return {client: EngineCoreOutputs(outputs) for client, outputs in batches.items()}

    async def _notify(self, ready: bool) -> None:
        if self.on_ready is not None:
            try:
                await self.on_ready(ready)
            except Exception:
                logger.exception("readiness callback failed")

    def _route(self, batches: dict[int, EngineCoreOutputs]) -> None:
        for client_id, batch in batches.items():
            queue = self._queues.get(client_id)
            if queue is not None:
                queue.put_nowait(batch)

    async def shutdown(self) -> None:
        self.kv_events.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.to_thread(self._thread.shutdown, wait=True)


def refusal(request_id: str, exc: Exception, code: str | None = None) -> EngineCoreOutputs:
    """The output that tells a client its add was refused, and why: `code` if given
    ("internal": the engine's fault, HTTP 500, not the request's), else from `exc`."""
    if code is None and isinstance(exc, EngineUnavailableError):
        code = "unavailable"
    elif code is None and isinstance(exc, EngineOverloadedError):
        code = "resource_exhausted"
        logger.debug("refused %s: %s", request_id, exc)
    elif code is None:  # the request itself is invalid (ValueError, RequestRejectedError)
        logger.info("rejected %s: %s", request_id, exc)
    output = EngineCoreOutput(
        request_id, [], finish_reason="error", error=str(exc), error_code=code
    )
    return EngineCoreOutputs([output])
