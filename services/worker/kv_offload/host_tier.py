"""HostTier: KV block payloads kept in host memory, least recently used first out.

The scheduler's index decides what it holds (saves and drops); the byte bound here is
the backstop that keeps memory bounded if the two ever disagree (a block pushed out here
is then a host miss, read from its file or reported as a load failure).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}.")
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> [P] uint8

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, key: bytes, row: torch.Tensor) -> list[bytes]:
        """Keep `row` (its own memory: the caller's buffer is not held) under `key`; the
        keys pushed out to stay within capacity (oldest first)."""
        self.drop(key)
        if row.nbytes > self.capacity_bytes:
            return [key]
        self._rows[key] = row.clone()
        self.nbytes += row.nbytes
        evicted = []
        while self.nbytes > self.capacity_bytes:
            old, old_row = self._rows.popitem(last=False)
            self.nbytes -= old_row.nbytes
            evicted.append(old)
        return evicted

    def get(self, key: bytes) -> torch.Tensor | None:
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
        return row

    def drop(self, key: bytes) -> None:
        row = self._rows.pop(key, None)
        if row is not None:
            self.nbytes -= row.nbytes
