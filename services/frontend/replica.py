"""Replica: one data-parallel engine core as a router sees it.

Its EngineCoreClient, what its prefix cache holds (PrefixIndex, kept current by the
engine's KV events), its last reported load and the requests the router sent it that
have not ended. `watch()` follows the engine's KV event stream for as long as the client
lives, starting over (and forgetting what it knew) whenever the stream breaks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from services.common.backoff import Backoff
from services.common.block_hash import BlockHash
from services.common.engine_output import SchedulerStats
from services.common.kv_events import KvEventBatch
from services.frontend.engine_client import EngineCoreClient
from services.frontend.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

WATCH_BACKOFF = Backoff((0.2, 0.5, 1.0, 2.0))  # between broken KV event streams


class Replica:
    def __init__(self, name: str, client: EngineCoreClient, address: str | None = None) -> None:
        self.name = name  # the `engine` label of its metrics
        self.client = client
        self.address = address or name
        self.index = PrefixIndex()
        self.stats = SchedulerStats()  # as last reported with a KV event batch
        self.in_flight: set[str] = set()  # request (group) ids routed here, not ended
        self.block_size = 0  # from the engine's KV events; 0 until the first batch
        self.prefix_caching = True
        self.dead = False  # its engine can never come back

    def __repr__(self) -> str:
        return f"Replica({self.name}, {self.address})"

    @property
    def routable(self) -> bool:
        return not self.dead and self.client.ready

    @property
    def load(self) -> int:
        reported = self.stats.num_running_reqs + self.stats.num_waiting_reqs
        return max(reported, len(self.in_flight))

    @property
    def cached_blocks(self) -> int:
        return len(self.index)

    def matched_blocks(self, hashes: Sequence[BlockHash]) -> float:
        return self.index.match(hashes) if self.prefix_caching else 0

    def apply(self, batch: KvEventBatch) -> None:
        self.index.apply(batch)
        if batch.stats is not None:
            self.stats = batch.stats
        if batch.block_size:
            self.block_size = batch.block_size
        self.prefix_caching = batch.prefix_caching

    def lost(self) -> None:
        """The engine core's requests are gone and its cache is unknown."""
        self.in_flight.clear()
        self.index.clear()
        self.stats = SchedulerStats()

    async def watch(self) -> None:
        """Apply the engine's KV events until cancelled; reconnect when the stream breaks."""
        attempt = 0
        while not self.dead:
            try:
                async for batch in self.client.watch_kv_events():
                    attempt = 0
                    self.apply(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.debug("KV events of replica %s broke: %s", self.name, exc)
            self.index.clear()
            await asyncio.sleep(WATCH_BACKOFF.delay(attempt))
            attempt += 1
