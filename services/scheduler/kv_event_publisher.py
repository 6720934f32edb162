"""KvEventPublisher: one engine core's prefix-cache changes and load, fanned out to routers.

A subscriber (a frontend's router, over EngineCore.WatchKvEvents) first gets a snapshot
(reset, every cached hash), then a batch after each step that changed the cache or the
load. Recording in the BlockPool is on only while someone listens. A subscriber that
falls MAX_BACKLOG batches behind gets a fresh snapshot instead of the backlog. After the
engine core is rebuilt (its workers came back) every subscriber starts over from a
snapshot of the new, empty cache. The caller holds the engine core's lock around every
call: the pool must not change while it is read. With KV offload tiers their index
records into the same log, and a batch that resets lists every key the tiers hold.
"""

from __future__ import annotations

import asyncio

from services.common.kv_events import KvEventBatch, KvEventLog

MAX_BACKLOG = 256


class KvEventPublisher:
    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler
        self._subscribers: list[asyncio.Queue] = []
        self._last_load: tuple | None = None

    def attach(self, scheduler) -> None:
        """Follow a new scheduler (a rebuilt engine core): everyone starts over."""
        self._scheduler = scheduler
        self._set_recording()
        for queue in self._subscribers:
            self._restart(queue)

    def subscribe(self) -> asyncio.Queue:
        """A queue of KvEventBatch, a snapshot first; None in it means the end."""
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.append(queue)
        self._set_recording()
        queue.put_nowait(self._snapshot())
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        if queue in self._subscribers:
            self._subscribers.remove(queue)
        self._set_recording()

    def publish(self) -> None:
        """After a step: the changes since the last batch, when the cache or load moved."""
        if not self._subscribers:
            return
        pool, stats = self._scheduler.kv.pool, self._scheduler.get_stats()
        load = (stats.num_running_reqs, stats.num_waiting_reqs, round(stats.kv_cache_usage, 2))
        if not pool.events and load == self._last_load:
            return
        self._last_load = load
        batch = pool.events.drain() if pool.events is not None else KvEventBatch()
        if batch.reset:  # the device cache was cleared: the tiers' keys are sent whole
            batch.stored_offloaded = self._offloaded()
            batch.removed_offloaded = []
        self._describe(batch)
        batch.stats = stats
        for queue in self._subscribers:
            if queue.qsize() >= MAX_BACKLOG:
                self._restart(queue)
            else:
                queue.put_nowait(batch)

    def close(self) -> None:
        """End every subscription (the engine core is gone for good)."""
        for queue in self._subscribers:
            queue.put_nowait(None)
        self._subscribers.clear()
        self._set_recording()

    def _set_recording(self) -> None:
        pool, offload = self._scheduler.kv.pool, self._scheduler.kv.offload
        if not self._subscribers:
            pool.events = None
        elif pool.events is None:
            pool.events = KvEventLog()
        if offload is not None:
            offload.events = pool.events

    def _offloaded(self) -> list:
        offload = self._scheduler.kv.offload
        return sorted(offload.keys()) if offload is not None else []

    def _snapshot(self) -> KvEventBatch:
        pool = self._scheduler.kv.pool
        batch = KvEventBatch(
            reset=True,
            stored=list(pool.cached_block_hash_to_block),
            stored_offloaded=self._offloaded(),
        )
        self._describe(batch)
        batch.stats = self._scheduler.get_stats()
        return batch

    def _describe(self, batch: KvEventBatch) -> None:
        batch.block_size = self._scheduler.block_size
        batch.prefix_caching = self._scheduler.kv.enable_caching

    def _restart(self, queue: asyncio.Queue) -> None:
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(self._snapshot())
