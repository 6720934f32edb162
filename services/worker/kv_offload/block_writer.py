"""BlockWriter: KV block files written on a background thread, off the step's path.

A bounded queue of pending writes (by bytes): when a save would overflow it, the oldest
pending writes are given up rather than blocking the step, and recorded in `unpersisted`
(as are writes the disk refused). The scheduler's index may then list a key that has no
file: a later load of it fails and the scheduler recomputes, which is always safe. A
pending write's bytes serve a load of its key until the file is written.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from pathlib import Path

import torch

from services.common import kv_block_file

logger = logging.getLogger(__name__)

_UNPERSISTED = 1 << 16


class BlockWriter:
    def __init__(
        self, directory: Path, identity: bytes, max_pending_bytes: int, fsync: bool = False
    ) -> None:
        if max_pending_bytes < 1:
            raise ValueError(f"max_pending_bytes must be >= 1, got {max_pending_bytes}.")
        self.directory = directory
        self.identity = identity
        self.max_pending_bytes = max_pending_bytes
        self.fsync = fsync
        # keys given up (queue full, disk error), oldest first; the newest _UNPERSISTED kept
        self.unpersisted: deque[bytes] = deque(maxlen=_UNPERSISTED)
        self._pending: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # key -> [P] uint8
        self._pending_bytes = 0
        self._writing: tuple[bytes, torch.Tensor] | None = None
        self._cancelled = False  # the key being written was dropped meanwhile: delete it after
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="pagestream-kv-writer", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, row: torch.Tensor) -> None:
        """Queue `row` (held, not copied: the caller never writes into it again) for
        `key`'s file; never blocks."""
        with self._changed:
            if self._closed:
                raise RuntimeError("the KV block writer is closed")
            self._discard(key)
            self._pending[key] = row
            self._pending_bytes += row.nbytes
            given_up = 0
            while self._pending_bytes > self.max_pending_bytes and len(self._pending) > 1:
                old, old_row = self._pending.popitem(last=False)
                self._pending_bytes -= old_row.nbytes
                self.unpersisted.append(old)
                given_up += 1
            self._changed.notify_all()
        if given_up:
            logger.warning("KV offload: the disk writer is behind; %d blocks not written", given_up)

    def pending(self, key: bytes) -> torch.Tensor | None:
        """The bytes of `key`'s write not yet on disk (queued or being written), else None."""
        with self._changed:
            row = self._pending.get(key)
            if row is None and self._writing is not None and self._writing[0] == key:
                row = self._writing[1]
            return row

    def cancel(self, key: bytes) -> None:
        """Forget `key`'s pending write; one being written is deleted once written."""
        with self._changed:
            self._discard(key)
            if self._writing is not None and self._writing[0] == key:
                self._cancelled = True

    def take_unpersisted(self) -> list[bytes]:
        with self._changed:
            keys = list(self.unpersisted)
            self.unpersisted.clear()
            return keys

    def flush(self) -> None:
        """Wait until every queued write is on disk (or given up)."""
        with self._changed:
            self._changed.wait_for(lambda: not self._pending and self._writing is None)

    def close(self) -> None:
        """Flush, then stop the thread."""
        self.flush()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()

    def _discard(self, key: bytes) -> None:
        row = self._pending.pop(key, None)
        if row is not None:
            self._pending_bytes -= row.nbytes

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return  # closed and drained
                key, row = self._pending.popitem(last=False)
                self._pending_bytes -= row.nbytes
                self._writing, self._cancelled = (key, row), False
            self._write(key, row)
            with self._changed:
                if self._cancelled:
                    kv_block_file.remove(self.directory, key)
                self._writing = None
                self._changed.notify_all()

    def _write(self, key: bytes, row: torch.Tensor) -> None:
        path = kv_block_file.block_path(self.directory, key)
        try:
            kv_block_file.write(path, self.identity, key, row.numpy().data, self.fsync)
        except Exception as exc:  # a full disk, a removed folder: the step goes on
            with self._changed:
                self.unpersisted.append(key)
            logger.warning("KV offload: writing %s failed (%s)", path, exc)
