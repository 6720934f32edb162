"""Prefix-cache events: how an engine core tells its routers what its cache holds.

The scheduler's BlockPool records each change of its hash index in a KvEventLog (a block
registered under a hash, a hash evicted, the whole cache cleared); the engine core drains
the log after every step into a KvEventBatch for each subscriber. A router that applies
the batches in order holds the same set of hashes as the engine's index: `reset` first
(forget everything), then `stored`, then `removed`. The log keeps only the last change of
each hash, so one batch never says "stored" and "removed" for the same hash.

With KV offload tiers the same log records the tiers' index (services/scheduler/
kv_offload_index.py) beside it: `stored_offloaded`, hashes some tier (host memory, disk)
holds now, `removed_offloaded`, hashes no tier holds any more. A router counts a prefix
the tiers hold as a hit worth less than the device's (it is read back, not recomputed).
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
    stored_offloaded: list[BlockHash] = field(default_factory=list)
    removed_offloaded: list[BlockHash] = field(default_factory=list)

    def apply_to(self, hashes: set[BlockHash]) -> None:
        if self.reset:
            hashes.clear()
        hashes.update(self.stored)
        hashes.difference_update(self.removed)

    def apply_offloaded_to(self, hashes: set[BlockHash]) -> None:
        """The same for the set of hashes the offload tiers hold."""
        if self.reset:
            hashes.clear()
        hashes.update(self.stored_offloaded)
        hashes.difference_update(self.removed_offloaded)


class KvEventLog:
    """The changes to one BlockPool's hash index (and its offload tiers') since the last drain."""

    def __init__(self) -> None:
        self._changes: dict[BlockHash, bool] = {}  # hash -> cached now (last change wins)
        self._offloaded: dict[BlockHash, bool] = {}  # hash -> in a tier now (the same)
        self._cleared = False

    def stored(self, block_hash: BlockHash) -> None:
        self._changes[block_hash] = True

    def removed(self, block_hash: BlockHash) -> None:
        self._changes[block_hash] = False

    def offloaded(self, block_hash: BlockHash, held: bool) -> None:
        """A tier took the hash (held) or the last tier holding it let it go."""
        self._offloaded[block_hash] = held

    def cleared(self) -> None:
        """The device cache forgot everything (the tiers keep theirs: recorded again)."""
        self._changes.clear()
        self._cleared = True

    def __bool__(self) -> bool:
        return self._cleared or bool(self._changes) or bool(self._offloaded)

    def drain(self) -> KvEventBatch:
        batch = KvEventBatch(
            reset=self._cleared,
            stored=[h for h, cached in self._changes.items() if cached],
            removed=[h for h, cached in self._changes.items() if not cached],
            stored_offloaded=[h for h, held in self._offloaded.items() if held],
            removed_offloaded=[h for h, held in self._offloaded.items() if not held],
        )
        self._changes.clear()
        self._offloaded.clear()
        self._cleared = False
        return batch
