"""TokenClock: when each request's tokens arrive, from an offline engine's step outputs
(per-request TPOT for the speculative and LoRA benchmarks)."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator


class TokenClock:
    """When each request's tokens arrive, from every engine step's outputs."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.count: Counter[str] = Counter()

    @contextlib.contextmanager
    def attached(self, engine) -> Iterator[TokenClock]:
        """Clock the outputs of `engine` (a pagestream LLMEngine) inside the block."""
        core = engine.core
        step = core.step

        def clocked():
            batches = step()
            now = time.perf_counter()
            for batch in batches.values():
                for output in batch.outputs:
                    self._saw(output.request_id, len(output.new_token_ids), now)
            return batches

        core.step = clocked
        try:
            yield self
        finally:
            del core.step  # back to the class's method

    def _saw(self, request_id: str, num_tokens: int, now: float) -> None:
        if num_tokens:
            self.first.setdefault(request_id, now)
            self.last[request_id] = now
            self.count[request_id] += num_tokens

    def tpot_ms(self) -> list[float]:
        """Each request's time per output token after its first (requests of 2+ tokens)."""
        return [
            (self.last[rid] - self.first[rid]) / (n - 1) * 1e3
            for rid, n in self.count.items()
            if n > 1
        ]
