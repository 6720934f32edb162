"""Prefix-cache events: how an engine core tells its routers what its cache holds.

The scheduler's BlockPool records each change of its hash index in a KvEventLog (a block
registered under a hash, a hash evicted, the whole cache cleared); the engine core drains
the log after every step into a KvEventBatch for each subscriber. A router that applies
the batches in order holds the same set of hashes as the engine's index: `reset` first
(forget everything), then `stored`, then `removed`. The log keeps only the last change of
each hash, so one batch never says "stored" and "removed" for the same hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.block_hash import BlockHash
from services.common.engine_output import SchedulerStats


@dataclass
class KvEventBatch:
    reset: bool = False  # forget what you knew about this cache, then apply the rest
    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    stats: SchedulerStats | None = None  # the engine's load when the batch was cut
    block_size: int = 0  # tokens per block: what the router hashes prompts with
    prefix_caching: bool = True  # False: the engine caches nothing, route by load only

    def apply_to(self, hashes: set[BlockHash]) -> None:
        if self.reset:
            hashes.clear()
        hashes.update(self.stored)
        hashes.difference_update(self.removed)


class KvEventLog:
    """The changes to one BlockPool's hash index since the last drain."""

    def __init__(self) -> None:
        self._changes: dict[BlockHash, bool] = {}  # hash -> cached now (last change wins)
        self._cleared = False

    def stored(self, block_hash: BlockHash) -> None:
        self._changes[block_hash] = True

    def removed(self, block_hash: BlockHash) -> None:
        self._changes[block_hash] = False

    def cleared(self) -> None:
        self._changes.clear()
        self._cleared = True

    def __bool__(self) -> bool:
        return self._cleared or bool(self._changes)

    def drain(self) -> KvEventBatch:
        batch = KvEventBatch(
            reset=self._cleared,
            stored=[h for h, cached in self._changes.items() if cached],
            removed=[h for h, cached in self._changes.items() if not cached],
        )
        self._changes.clear()
        self._cleared = False
        return batch
