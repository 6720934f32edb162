"""KV-cache utilisation after every engine step: real tokens over the slots of held blocks, and
over preallocating ``max_model_len`` ("max") or ``prompt + output`` ("oracle") slots per live
request (the PagedAttention paper's Orca Max / Oracle)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

from benchmarks.workload import BenchRequest


class KVUtilizationSampler:
    def __init__(self, engine, requests: list[BenchRequest] | None = None) -> None:
        self.engine = engine  # pagestream.llm_engine.LLMEngine
        self.max_model_len = engine.scheduler.max_model_len
        self.block_size = engine.scheduler.block_size
        self._final_len = {
            tuple(r.prompt_token_ids): r.prompt_len + r.output_len for r in requests or []
        }
        self.samples: list[dict] = []
        self.peak_blocks = 0  # distinct blocks held by running requests
        self.peak_pool_blocks = 0  # blocks out of the pool (any holder, beams in waiting too)
        self.overhead_s = 0.0  # time spent sampling (subtracted from the timed runs)

    @property
    def num_steps(self) -> int:
        return len(self.samples)

    @contextlib.contextmanager
    def attached(self) -> Iterator[KVUtilizationSampler]:
        """Sample after every ``engine.step()`` while the block runs."""
        step = self.engine.step

        def sampled_step():
            outputs = step()
            start = time.perf_counter()
            self.sample()
            self.overhead_s += time.perf_counter() - start
            return outputs

        self.engine.step = sampled_step
        try:
            yield self
        finally:
            del self.engine.step  # back to the class's method

    def sample(self) -> None:
        scheduler = self.engine.scheduler
        kv = scheduler.kv
        self.peak_pool_blocks = max(self.peak_pool_blocks, kv.num_blocks - kv.num_free_blocks)
        filled: dict[int, int] = {}  # block id -> slots holding real tokens
        live = [r for r in scheduler.running if r.request_id in kv.req_to_blocks]
        for request in live:
            for blocks in kv.req_to_blocks[request.request_id]:  # one list per KV-cache group
                remaining = request.num_computed_tokens
                for block in blocks:
                    count = min(remaining, self.block_size)
                    filled[block.block_id] = max(filled.get(block.block_id, 0), count)
                    remaining -= count
        self.peak_blocks = max(self.peak_blocks, len(filled))
        if live:
            oracle = (self._final_len.get(tuple(r.prompt_token_ids), r.num_tokens) for r in live)
            self.samples.append(
                {
                    "num_live": len(live),
                    "real": sum(filled.values()),
                    "used": len(filled) * self.block_size,
                    "reserved_max": len(live) * self.max_model_len,
                    "reserved_oracle": sum(oracle),
                }
            )

    def summary(self) -> dict:
        """Mean utilisation over the sampled steps (and the time series, downsampled)."""
        if not self.samples:
            return {"num_samples": 0}

        def mean_of(key: str) -> float:
            return round(statistics.fmean(s["real"] / s[key] for s in self.samples if s[key]), 4)

        return {
            "num_samples": len(self.samples),
            "paged": mean_of("used"),
            "prealloc_max": mean_of("reserved_max"),
            "prealloc_oracle": mean_of("reserved_oracle"),
            "peak_blocks": self.peak_blocks,
            "peak_pool_blocks": self.peak_pool_blocks,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "series": self.samples[:: max(1, len(self.samples) // 200)],
        }
