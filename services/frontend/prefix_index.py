"""PrefixIndex: what a router believes one replica's prefix cache holds.

Two sets of block hashes: `confirmed`, the engine's own index as its KV events report it
(services/common/kv_events.py), and `predicted`, hashes of prompts routed to the replica
that it has not reported yet. Without predictions the second request of a conversation
would arrive before the first one's prefill stored its blocks, find nothing, and go
elsewhere. A prediction lasts until the engine reports the hash (stored or removed) or
for PREDICTION_TTL_S, whichever comes first. A third set, `offloaded`, holds the hashes
the replica's KV offload tiers (host memory, disk) hold: a prefix continuing there counts
OFFLOAD_WEIGHT a block (read back, which costs less than a prefill but more than nothing).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from services.common.block_hash import BlockHash
from services.common.kv_events import KvEventBatch

PREDICTION_TTL_S = 30.0
MAX_PREDICTIONS = 1 << 18  # expired ones are swept when the table grows past this
OFFLOAD_WEIGHT = 0.5  # a block the tiers hold, against one the device holds


class PrefixIndex:
    def __init__(self, clock=time.monotonic) -> None:
        self.confirmed: set[BlockHash] = set()
        self.predicted: dict[BlockHash, float] = {}  # hash -> expiry (clock seconds)
        self.offloaded: set[BlockHash] = set()
        self._clock = clock

    def __len__(self) -> int:
        """Blocks held or about to be (a recent prediction counts: two first turns that
        arrive back to back should not both find the same replica emptiest)."""
        return len(self.confirmed) + len(self.predicted)

    def apply(self, batch: KvEventBatch) -> None:
        if batch.reset:
            self.predicted.clear()
        batch.apply_to(self.confirmed)
        batch.apply_offloaded_to(self.offloaded)
        for block_hash in (*batch.stored, *batch.removed):
            self.predicted.pop(block_hash, None)

    def clear(self) -> None:
        self.confirmed.clear()
        self.predicted.clear()
        self.offloaded.clear()

    def predict(self, hashes: Sequence[BlockHash]) -> None:
        expiry = self._clock() + PREDICTION_TTL_S
        for block_hash in hashes:
            if block_hash not in self.confirmed:
                self.predicted[block_hash] = expiry
        if len(self.predicted) > MAX_PREDICTIONS:
            self._sweep()

    def match(self, hashes: Sequence[BlockHash]) -> float:
        """How many leading blocks of `hashes` the replica holds (or will soon) on its
        device, plus OFFLOAD_WEIGHT for each following one its offload tiers hold."""
        now = self._clock()
        matched = 0
        for block_hash in hashes:
            expiry = self.predicted.get(block_hash)
            if block_hash not in self.confirmed and (expiry is None or expiry < now):
                break
            matched += 1
        offloaded = 0
        for block_hash in hashes[matched:]:
            if block_hash not in self.offloaded:
                break
            offloaded += 1
        return matched + OFFLOAD_WEIGHT * offloaded

    def _sweep(self) -> None:
        now = self._clock()
        self.predicted = {h: t for h, t in self.predicted.items() if t >= now}
