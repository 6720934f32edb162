"""KVOffloadStore: runs a step's kv_drops / kv_loads / kv_saves against the KV cache.

Tiers: host memory (HostTier, when host bytes > 0) and one file per block in the model's
identity folder (BlockWriter writes them in the background). The scheduler's index says
what each tier holds; the store follows it and reports what it could not read:
- drop(pairs): (key, "host" | "disk"): forget the key in that tier (a pending write is
  cancelled, the file deleted).
- load(pairs) -> failed keys: (key, device block): host tier first, else a pending
  write's bytes, else the file (read and verified on a small thread pool); what was found
  is copied into its blocks by one scatter per cache tensor; a failed key's block is left
  untouched.
- save(pairs): (device block, key), after the forward: one gather per cache tensor into
  host rows; the host tier keeps a copy, the writer queues the file.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from services.common import kv_block_file
from services.worker.kv_offload.block_copy import block_nbytes, gather_blocks, scatter_blocks
from services.worker.kv_offload.block_writer import BlockWriter
from services.worker.kv_offload.host_tier import HostTier

logger = logging.getLogger(__name__)

TIERS = ("host", "disk")
DEFAULT_PENDING_BYTES = 256 * 1024**2  # the writer's queue: ~0.5 s of a fast disk
READ_THREADS = 4
_STALE_TEMPORARY_S = 600.0


class KVOffloadStore:
    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        identity: bytes,
        directory: Path | None,
        host_bytes: int,
        max_pending_bytes: int = DEFAULT_PENDING_BYTES,
        fsync: bool = False,
    ) -> None:
        """`caches`: the distinct cache tensors, each [2, num_blocks, ...] (every engine's
        kv_caches: the target's and a draft model's); `directory`: the identity's folder
        (None: no disk tier); `host_bytes`: the host tier's bound (0: none)."""
        if not caches:
            raise ValueError("a KV offload store needs at least one cache tensor")
        self.caches = list(caches)
        self.num_blocks = self.caches[0].shape[1]
        if any(cache.shape[1] != self.num_blocks for cache in self.caches):
            raise ValueError("every cache tensor of a KV offload store must hold num_blocks")
        self.identity = identity
        self.block_nbytes = block_nbytes(self.caches)
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.directory = directory
        self.writer = None
        self._readers = None
        if directory is not None:
            kv_block_file.remove_stale_temporaries(directory, _STALE_TEMPORARY_S)
            self.writer = BlockWriter(directory, identity, max_pending_bytes, fsync)
            self._readers = ThreadPoolExecutor(
                READ_THREADS, thread_name_prefix="pagestream-kv-read"
            )

    def drop(self, pairs: Sequence[tuple[bytes, str]]) -> None:
        for key, tier in pairs:  # all checked before any is applied
            _check_key(key)
            if tier not in TIERS:
                raise ValueError(f"kv_drops tier must be one of {', '.join(TIERS)}; got {tier!r}.")
        for key, tier in pairs:
            if tier == "host" and self.host is not None:
                self.host.drop(key)
            elif tier == "disk" and self.writer is not None:
                self.writer.cancel(key)
                kv_block_file.remove(self.directory, key)

    def load(self, pairs: Sequence[tuple[bytes, int]]) -> list[bytes]:
        """Copy each key's block into its device block; the keys that could not be read."""
        if not pairs:
            return []
        blocks = self._check_blocks([block for _, block in pairs], "kv_loads", distinct=True)
        for key, _ in pairs:
            _check_key(key)
        device = self.caches[0].device
        rows = torch.empty(
            (len(pairs), self.block_nbytes), dtype=torch.uint8, pin_memory=device.type == "cuda"
        )  # [m, P]: row i is pairs[i]'s payload once found
        found = [self._copy_in_memory(key, rows[i]) for i, (key, _) in enumerate(pairs)]
        missing = [i for i, ok in enumerate(found) if not ok]
        for i, ok in zip(missing, self._read_files(pairs, missing, rows), strict=True):
            found[i] = ok
        if all(found):
            scatter_blocks(self.caches, torch.tensor(blocks, dtype=torch.int64), rows)
        elif any(found):
            kept = [i for i, ok in enumerate(found) if ok]
            ids = torch.tensor([blocks[i] for i in kept], dtype=torch.int64)
            scatter_blocks(self.caches, ids, rows[torch.tensor(kept)])
        return [key for (key, _), ok in zip(pairs, found, strict=True) if not ok]

    def save(self, pairs: Sequence[tuple[int, bytes]]) -> None:
        """Copy the blocks out (one gather per cache tensor) into every tier."""
        if not pairs or (self.host is None and self.writer is None):
            return
        blocks = self._check_blocks([block for block, _ in pairs], "kv_saves")
        for _, key in pairs:
            _check_key(key)
        rows = gather_blocks(self.caches, torch.tensor(blocks, dtype=torch.int64))  # [n, P]
        if self.caches[0].device.type == "cuda":
            torch.cuda.current_stream(self.caches[0].device).synchronize()
        for (_, key), row in zip(pairs, rows, strict=True):
            if self.host is not None:
                self.host.put(key, row)
            if self.writer is not None:
                self.writer.submit(key, row)

    def unpersisted(self) -> list[bytes]:
        """Keys whose file was given up since the last call (the writer was behind or the
        disk refused): the scheduler may forget them (a load of one fails anyway)."""
        return [] if self.writer is None else self.writer.take_unpersisted()

    def flush(self) -> None:
        """Wait until every queued file is written."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Write what is pending, then stop the threads."""
        if self.writer is not None:
            self.writer.close()
            self._readers.shutdown(wait=True)
            self.writer = None

    def _copy_in_memory(self, key: bytes, row: torch.Tensor) -> bool:
        """Copy `key`'s payload from the host tier or a pending write into `row`."""
        payload = self.host.get(key) if self.host is not None else None
        if payload is None and self.writer is not None:
            payload = self.writer.pending(key)
        if payload is None:
            return False
        row.copy_(payload)
        return True

    def _read_files(
        self, pairs: Sequence[tuple[bytes, int]], indices: list[int], rows: torch.Tensor
    ) -> list[bool]:
        """Read and verify pairs[i]'s file into rows[i] for each i in `indices`, in
        parallel (file reads and sha256 release the GIL); which succeeded."""
        if not indices or self._readers is None:
            return [False] * len(indices)

        def read(i: int) -> bool:
            key = pairs[i][0]
            path = kv_block_file.block_path(self.directory, key)
            ok = kv_block_file.read_into(path, self.identity, key, rows[i].numpy().data)
            if not ok:
                logger.info("KV offload: block %s unreadable or missing", path.name)
            return ok

        return list(self._readers.map(read, indices))

    def _check_blocks(self, blocks: list[int], what: str, distinct: bool = False) -> list[int]:
        bad = [b for b in blocks if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"{what} block ids {bad[:8]} are out of range [0, {self.num_blocks}).")
        if distinct and len(set(blocks)) != len(blocks):
            raise ValueError(f"{what} names a device block twice.")
        return blocks


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != kv_block_file.KEY_BYTES:
        raise ValueError(
            f"a KV offload key must be {kv_block_file.KEY_BYTES} bytes, got {key!r:.80}."
        )
