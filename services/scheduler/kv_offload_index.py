"""KvOffloadIndex: which block hashes the KV offload tiers hold, and the policy over them.

The worker's store (services/worker/kv_offload/) holds the bytes; the scheduler holds this
index and decides: every tier is an LRU bounded in blocks, saves are write-through (a key
enters every tier at once), a key pushed out of a tier becomes a drop (key, tier) the next
plan carries. Drops wait for the next schedule(): a plan applies its drops before its loads
and its saves, so a key evicted and saved (or loaded) in one step is never deleted after the
step wrote or read it; a key added back before its drop went out cancels the drop.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable

from services.common.block_hash import BlockHash
from services.common.convert.plan_limits import KV_KEY_BYTES, KV_TIERS, MAX_KV_DROPS
from services.common.kv_events import KvEventLog

HOST, DISK = KV_TIERS


class LruKeys:
    """At most `capacity` keys, least recently used first; adding past it evicts."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"an LRU's capacity must be >= 0 blocks, got {capacity}.")
        self.capacity = capacity
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        return iter(self._keys)

    def touch(self, key: BlockHash) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def add(self, key: BlockHash) -> list[BlockHash]:
        """Add (or refresh) `key`; the keys evicted to keep within capacity."""
        if not self.capacity:
            return []
        self._keys[key] = None
        self._keys.move_to_end(key)
        evicted = []
        while len(self._keys) > self.capacity:
            old, _ = self._keys.popitem(last=False)
            evicted.append(old)
        return evicted

    def discard(self, key: BlockHash) -> bool:
        """Forget `key`; whether it was held."""
        if key not in self._keys:
            return False
        del self._keys[key]
        return True


class KvOffloadIndex:
    def __init__(self, host_blocks: int, disk_blocks: int) -> None:
        """`host_blocks` / `disk_blocks`: each tier's bound in blocks (0: the tier is off)."""
        self.tiers = {HOST: LruKeys(host_blocks), DISK: LruKeys(disk_blocks)}
        self.tiers = {name: lru for name, lru in self.tiers.items() if lru.capacity}
        self._drops: dict[tuple[BlockHash, str], None] = {}  # ordered set, for the next plan
        # Set by an engine core with routers listening (the BlockPool's log): every key
        # that enters the tiers or leaves the last tier holding it.
        self.events: KvEventLog | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def __contains__(self, key: BlockHash) -> bool:
        return any(key in lru for lru in self.tiers.values())

    def tiers_of(self, key: BlockHash) -> tuple[str, ...]:
        return tuple(name for name, lru in self.tiers.items() if key in lru)

    def add(self, key: BlockHash) -> None:
        """A block full on the device is saved to every tier (write-through)."""
        self._record(key, True)
        for name, lru in self.tiers.items():
            self._drops.pop((key, name), None)  # its pending drop would delete the save
            for old in lru.add(key):
                self._drop(old, name)

    def hit(self, key: BlockHash) -> None:
        """A prefix hit reads the key back: most recently used in every tier."""
        for lru in self.tiers.values():
            lru.touch(key)

    def forget(self, key: BlockHash) -> None:
        """The key's contents are not to be trusted (a failed load, a step that wrote
        garbage after one): every tier drops it."""
        for name, lru in self.tiers.items():
            if lru.discard(key):
                self._drop(key, name)

    def fill_disk(self, entries: Iterable[tuple[BlockHash, int, float]]) -> int:
        """What a restarted server finds on disk (kv_block_file.scan: (key, nbytes, mtime)),
        oldest first so the newest stay when they exceed the bound; how many were taken.
        Files past the bound are dropped with the first plan."""
        if DISK not in self.tiers:
            return 0
        disk = self.tiers[DISK]
        for key, _nbytes, _mtime in sorted(entries, key=lambda entry: entry[2]):
            if len(key) != KV_KEY_BYTES:
                continue
            self._record(key, True)
            for old in disk.add(key):
                self._drop(old, DISK)
        return len(disk)

    def _drop(self, key: BlockHash, tier: str) -> None:
        """`tier` let `key` go: the worker's store forgets it with the next plan."""
        self._drops[(key, tier)] = None
        if key not in self:
            self._record(key, False)

    def _record(self, key: BlockHash, held: bool) -> None:
        if self.events is not None:
            self.events.offloaded(key, held)

    def keys(self) -> set[BlockHash]:
        """Every key some tier holds."""
        return {key for lru in self.tiers.values() for key in lru}

    def take_drops(self) -> list[tuple[BlockHash, str]]:
        """The drops for the next plan (at most MAX_KV_DROPS; the rest wait)."""
        drops = list(itertools.islice(self._drops, MAX_KV_DROPS))
        for drop in drops:
            del self._drops[drop]
        return drops


def blocks_within(budget_bytes: int, bytes_per_block: int) -> int:
    """How many blocks of `bytes_per_block` a tier of `budget_bytes` holds (0: off)."""
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}.")
    return max(budget_bytes, 0) // bytes_per_block
