"""ABWorkload: one workload of an A/B benchmark (benchmarks/ab_driver.py): its requests (an
output_len is the request's max_tokens), whether they ignore EOS, the batches it runs at and
how many requests a run takes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from benchmarks.workload import BenchRequest


@dataclass(frozen=True)
class ABWorkload:
    name: str
    requests: list[BenchRequest]
    ignore_eos: bool = True
    batches: tuple[int | None, ...] = (None,)  # requests per generate call (None: all)
    num_requests: int | None = None  # per run at least (rounded up to its batch; None: all)
    max_adapters: int | None = None  # a variant's first adapters only (one chat: 1)

    def for_batch(self, batch: int | None) -> list[BenchRequest]:
        if self.num_requests is None:
            return self.requests
        step = batch or 1
        return self.requests[: step * math.ceil(self.num_requests / step)]

    def inputs(self, requests: list[BenchRequest]) -> tuple[list[dict], list]:
        from pagestream import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=self.ignore_eos)
            for r in requests
        ]
        return prompts, params

    def summary(self) -> dict:
        prompts = [r.prompt_len for r in self.requests]
        outputs = [r.output_len for r in self.requests]
        return {
            "num_requests": len(self.requests),
            "prompt_tokens": sum(prompts),
            "prompt_min": min(prompts),
            "prompt_median": float(np.median(prompts)),
            "prompt_max": max(prompts),
            "max_tokens": max(outputs),
            "ignore_eos": self.ignore_eos,
        }
