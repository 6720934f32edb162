"""DataParallelClient: one EngineCoreClient over several engine cores (replicas).

A Router picks a replica per request (router.py) and the client remembers who owns it, so
aborts and n > 1 / beam groups go to that replica only. When a replica's connection
breaks, only its own requests end (an "unavailable" error each; one that had produced
nothing is sent once more, to another replica), the router skips it while it is not
ready, and its task reconnects; the others never notice. `next_outputs` raises only once
the client is closed (or every replica is gone for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence

from services.common.backoff import Backoff
from services.common.block_hash import hash_request_tokens
from services.common.engine_errors import EngineUnavailableError
from services.common.engine_output import (
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
    add_stats,
)
from services.common.engine_request import EngineCoreRequest
from services.frontend.engine_client import EngineCoreClient
from services.frontend.replica import Replica
from services.frontend.router import Router, RouterConfig

logger = logging.getLogger(__name__)

# Between losses of one replica with no output in between: the first reconnect is immediate.
RECONNECT_BACKOFF = Backoff((0.0, 0.25, 0.5, 1.0, 2.0))
_GONE = object()  # in the output queue: every replica is gone for good


class DataParallelClient:
    def __init__(
        self,
        clients: Sequence[EngineCoreClient],
        config: RouterConfig | None = None,
        addresses: Sequence[str] | None = None,
    ) -> None:
        """Create inside the running event loop, from connected clients."""
        if not clients:
            raise ValueError("a data-parallel client needs at least one engine core")
        addresses = list(addresses or [None] * len(clients))
        pairs = enumerate(zip(clients, addresses, strict=True))
        self.replicas = [Replica(str(i), client, address) for i, (client, address) in pairs]
        self.router = Router(config)
        self.on_ready_change: Callable[[bool], None] | None = None
        self.decisions: Counter[tuple[str, str]] = Counter()  # (engine, reason) -> requests
        self._owner: dict[str, Replica] = {}
        # Requests with no output yet, kept so that a replica's loss can re-route them.
        self._unstarted: dict[str, EngineCoreRequest] = {}
        self._retried: set[str] = set()
        self._background: set[asyncio.Task] = set()
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._closed = False
        self._tasks: list[asyncio.Task] = []
        loop = asyncio.get_running_loop()
        for replica in self.replicas:
            replica.client.on_ready_change = lambda _ready: self._ready_changed()
            self._tasks.append(loop.create_task(self._pump(replica)))
            self._tasks.append(loop.create_task(replica.watch()))

    # ---- readiness -----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return not self._closed and any(r.routable for r in self.replicas)

    def _ready_changed(self) -> None:
        if self.on_ready_change is not None:
            self.on_ready_change(self.ready)

    async def reconnect(self) -> None:
        raise EngineUnavailableError(
            "the data-parallel client is closed" if self._closed else "every replica is gone"
        )

    # ---- requests ------------------------------------------------------------------------
    async def add_request(self, request: EngineCoreRequest) -> None:
        replica = self._route(request)
        self._owner[request.request_id] = replica
        self._unstarted[request.request_id] = request
        replica.in_flight.add(request.request_id)
        try:
            await replica.client.add_request(request)
        except BaseException:
            self.release(request.request_id)
            raise

    def _route(self, request: EngineCoreRequest, avoid: Replica | None = None) -> Replica:
        candidates = [r for r in self.replicas if r.routable and r is not avoid]
        if not candidates:
            raise EngineUnavailableError("no engine replica is ready: all are reconnecting")
        hashes = self._hashes(request, candidates)
        replica, reason = self.router.choose(candidates, hashes)
        self.decisions[(replica.name, reason)] += 1
        if hashes:
            replica.index.predict(hashes)
        logger.debug("request %s -> replica %s (%s)", request.request_id, replica.name, reason)
        return replica

    def _hashes(self, request: EngineCoreRequest, candidates: list[Replica]):
        block_size = next((r.block_size for r in candidates if r.block_size), 0)
        if not self.router.needs_hashes or len(candidates) < 2 or not block_size:
            return []
        lora = request.lora_request
        return hash_request_tokens(
            request.prompt_token_ids,
            block_size,
            cache_salt=request.cache_salt,
            lora_identity=lora.identity if lora else None,
            images=request.images,
        )

    async def abort(self, request_ids: list[str]) -> None:
        """To the owners; ids nobody owns (already released) go to every ready replica."""
        by_replica: dict[Replica, list[str]] = {}
        for rid in request_ids:
            owner = self._owner.get(rid)
            for replica in [owner] if owner else [r for r in self.replicas if r.routable]:
                by_replica.setdefault(replica, []).append(rid)
        await asyncio.gather(*(_abort(r, ids) for r, ids in by_replica.items()))

    def release(self, request_id: str) -> None:
        """The Frontend is done with this request (it ended, or was aborted)."""
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.in_flight.discard(request_id)
        self._unstarted.pop(request_id, None)
        self._retried.discard(request_id)

    def owner_of(self, request_id: str) -> str | None:
        replica = self._owner.get(request_id)
        return None if replica is None else replica.name

    async def next_outputs(self) -> EngineCoreOutputs:
        item = await self._outputs.get()
        if item is _GONE or self._closed:
            raise EngineUnavailableError("the data-parallel client is closed")
        return item

    # ---- per-replica output pumps --------------------------------------------------------
    async def _pump(self, replica: Replica) -> None:
        failures = 0
        while not self._closed:
            try:
                while True:
                    batch = await replica.client.next_outputs()
                    failures = 0
                    _count_finished(replica, batch.outputs)
                    outputs = [o for o in batch.outputs if not self._retry_later(replica, o)]
                    if outputs:
                        self._outputs.put_nowait(EngineCoreOutputs(outputs))
            except Exception as exc:
                self._replica_lost(replica, exc)
            await asyncio.sleep(RECONNECT_BACKOFF.delay(failures))
            failures += 1
            try:
                await replica.client.reconnect()
            except EngineUnavailableError as exc:
                self._replica_gone(replica, exc)
                return
            logger.info("replica %s (%s) is back", replica.name, replica.address)
            self._ready_changed()

    def _replica_lost(self, replica: Replica, exc: Exception) -> None:
        """End the replica's own requests with an error; the others carry on."""
        owned = [rid for rid, owner in self._owner.items() if owner is replica]
        logger.error(
            "lost replica %s (%s): %s; failing its %d request(s)",
            replica.name,
            replica.address,
            exc,
            len(owned),
        )
        message = f"engine replica {replica.name} ({replica.address}) failed: {exc}"
        replica.lost()
        errors = [_unavailable(rid, message) for rid in owned]
        errors = [e for e in errors if not self._retry_later(replica, e)]
        for output in errors:
            self._owner.pop(output.request_id, None)
        if errors:
            self._outputs.put_nowait(EngineCoreOutputs(errors))
        self._ready_changed()

    # ---- one more try for requests a dying replica took but never started --------------
    def _retry_later(self, replica: Replica, output: EngineCoreOutput) -> bool:
        """True when this output is a lost replica's "unavailable" error for a request
        that produced nothing yet: it is re-routed instead of ending the request."""
        rid = output.parent_request_id or output.request_id
        if output.error is None or output.error_code != "unavailable":
            if output.new_token_ids or output.finished:
                self._unstarted.pop(rid, None)
            return False
        request = self._unstarted.pop(rid, None)
        if request is None or rid in self._retried or self._owner.get(rid) is not replica:
            return False
        self._retried.add(rid)
        task = asyncio.get_running_loop().create_task(self._retry(request, replica, output))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return True

    async def _retry(
        self, request: EngineCoreRequest, failed: Replica, error: EngineCoreOutput
    ) -> None:
        rid = request.request_id
        failed.in_flight.discard(rid)
        try:
            replica = self._route(request, avoid=failed)
            self._owner[rid] = replica
            replica.in_flight.add(rid)
            logger.warning(
                "request %s: replica %s lost it; retrying on %s", rid, failed.name, replica.name
            )
            await replica.client.add_request(request)
        except Exception as exc:
            logger.error("request %s could not be retried: %s", rid, exc)
            self._owner.pop(rid, None)
            self._outputs.put_nowait(EngineCoreOutputs([error]))

    def _replica_gone(self, replica: Replica, exc: Exception) -> None:
        replica.dead = True
        if not self._closed:
            logger.error("replica %s can never come back: %s", replica.name, exc)
        if all(r.dead for r in self.replicas):
            self._outputs.put_nowait(_GONE)
        self._ready_changed()

    # ---- statistics ----------------------------------------------------------------------
    async def stats(self) -> SchedulerStats:
        """The replicas' numbers added up (KV usage: their mean)."""
        per_engine = list((await self.engine_stats()).values())
        return add_stats(per_engine)

    async def engine_stats(self) -> dict[str, SchedulerStats]:
        """Each replica's stats (the last reported ones where it cannot answer now)."""
        results = await asyncio.gather(
            *(r.client.stats() for r in self.replicas), return_exceptions=True
        )
        return {
            r.name: result if isinstance(result, SchedulerStats) else r.stats
            for r, result in zip(self.replicas, results, strict=True)
        }

    def routing_counts(self) -> dict[tuple[str, str], int]:
        return dict(self.decisions)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in [*self._tasks, *self._background]:
            task.cancel()
        for task in [*self._tasks, *self._background]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.gather(*(r.client.close() for r in self.replicas), return_exceptions=True)
        self._outputs.put_nowait(_GONE)


def _count_finished(replica: Replica, outputs: list[EngineCoreOutput]) -> None:
    """A request that ended there no longer loads the replica, even before its consumer
    reads the end (n > 1 groups: when the Frontend releases them)."""
    for output in outputs:
        if output.finished and output.parent_request_id is None:
            replica.in_flight.discard(output.request_id)


def _unavailable(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id, [], finish_reason="error", error=message, error_code="unavailable"
    )


async def _abort(replica: Replica, request_ids: list[str]) -> None:
    try:
        await replica.client.abort(request_ids)
    except EngineUnavailableError as exc:  # its loss ends those requests anyway
        logger.debug("abort on replica %s skipped: %s", replica.name, exc)
