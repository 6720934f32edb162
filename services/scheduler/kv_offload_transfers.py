"""KvOffloadTransfers: one engine's traffic with its KV offload tiers, step by step.

KvOffloadIndex says which keys the tiers hold; this says what moves: the blocks to read
back before a step's forward (loads) and to copy out after it (saves), which requests read
a loaded block before its step landed (so a failed load's garbage is traced through every
chain computed from it, ended requests' included), and the counts /metrics shows. The
KVCacheManager calls it where blocks are allocated and registered; the scheduler takes a
plan's transfers and lands its failures through the manager.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.block_hash import BlockHash
from services.scheduler.block_pool import BlockPool, KVCacheBlock
from services.scheduler.kv_offload_index import KvOffloadIndex
from services.scheduler.request import Request


class KvOffloadTransfers:
    def __init__(self, index: KvOffloadIndex, pool: BlockPool) -> None:
        self.index, self.pool = index, pool
        self.pending_loads: list[tuple[BlockHash, int]] = []  # (key, device block) for the plan
        self.pending_saves: list[tuple[int, BlockHash]] = []  # (device block, key) for the plan
        self.hits = 0  # tokens read back from a tier on prefix hits
        self.failures = 0  # blocks the worker could not read back
        # Loads whose step has not landed: block id -> (key, the requests that read the
        # block: its loader and device hits on it since).
        self._unconfirmed: dict[int, tuple[BlockHash, list[Request]]] = {}

    def num_held(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading `block_hashes` the tiers hold."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.index:
                break
            count += 1
        return count

    def read(self, request: Request, hit: Iterable[KVCacheBlock]) -> None:
        """`request` takes device hits `hit`: it reads those of them still being loaded."""
        if not self._unconfirmed:
            return
        for block in hit:
            if (unconfirmed := self._unconfirmed.get(block.block_id)) is not None:
                unconfirmed[1].append(request)

    def load(
        self, request: Request, first: int, blocks: list[KVCacheBlock], block_size: int
    ) -> None:
        """The tiers' contents of the request's block positions `first..` go into the fresh
        `blocks` before the step's forward."""
        for pos, block in enumerate(blocks, start=first):
            key = request.block_hashes[pos]
            self.index.hit(key)
            self.pending_loads.append((key, block.block_id))
            self._unconfirmed[block.block_id] = (key, [request])
        self.hits += len(blocks) * block_size

    def registered(self, block: KVCacheBlock, key: BlockHash) -> None:
        """`block` was just registered in the prefix cache under `key`: saved after this
        step's forward fills it, unless a tier holds the key already."""
        if key not in self.index:
            self.index.add(key)
            self.pending_saves.append((block.block_id, key))

    def land(
        self, loads: Sequence[tuple[BlockHash, int]], failures: Iterable[BlockHash]
    ) -> set[int]:
        """A plan's `loads` landed, the worker could not read `failures`: those keys, and
        every key after them in the chain of each request that read their blocks, leave the
        prefix cache and the tiers. The failed loads' block ids."""
        failed = set(failures)
        self.failures += len(failed)
        bad = set()
        for key, block_id in loads:
            unconfirmed = self._unconfirmed.get(block_id)
            readers = []
            if unconfirmed is not None and unconfirmed[0] == key:
                readers = self._unconfirmed.pop(block_id)[1]
            if key in failed:
                bad.add(block_id)
                for request in readers:
                    self._forget_chain(request, key)
        self.forget_keys(failed)  # a failure the plan did not load: only forgotten
        return bad

    def _forget_chain(self, request: Request, key: BlockHash) -> None:
        hashes = request.block_hashes
        if key in hashes:
            self.forget_keys(hashes[hashes.index(key) :])

    def forget_keys(self, keys: Iterable[BlockHash]) -> None:
        """The keys leave the prefix cache (whichever block holds them) and the tiers."""
        for key in keys:
            if (block := self.pool.get_cached_block(key)) is not None:
                self.pool.uncache(block)
            self.index.forget(key)

    def take(self) -> tuple[list, list]:
        """This step's (kv_loads, kv_saves), forgotten here."""
        loads, self.pending_loads = self.pending_loads, []
        saves, self.pending_saves = self.pending_saves, []
        return loads, saves
