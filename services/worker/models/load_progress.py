"""Progress of a long weight load, in the log: bytes read of the checkpoint's total.

`LoadProgress(source, total_bytes)`, then `add(tensor_bytes)` per tensor and `done()`. A
load shorter than INTERVAL_S logs one line at `done`; a longer one logs "loading weights of
X: 45% (440 of 984 MB, 2.1 s)" at most every INTERVAL_S seconds, as vLLM's and llama.cpp's
loaders do.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

INTERVAL_S = 2.0


class LoadProgress:
    def __init__(self, source: str, total_bytes: int) -> None:
        self.source = source
        self.total = max(int(total_bytes), 1)
        self.done_bytes = 0
        self.start = time.perf_counter()
        self.last = self.start

    def add(self, nbytes: int) -> None:
        self.done_bytes += int(nbytes)
        now = time.perf_counter()
        if now - self.last >= INTERVAL_S:
            self.last = now
            logger.info(
                "loading weights of %s: %d%% (%.0f of %.0f MB, %.1f s)",
                self.source,
                100 * self.done_bytes // self.total,
                self.done_bytes / 1e6,
                self.total / 1e6,
                now - self.start,
            )

    def done(self) -> None:
        logger.info(
            "read %.0f MB of weights from %s in %.1f s",
            self.done_bytes / 1e6,
            self.source,
            time.perf_counter() - self.start,
        )
