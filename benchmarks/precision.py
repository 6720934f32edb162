"""`pagestream bench precision`: bfloat16 against float32 (the baseline) on the CPU, side by
side on the A/B driver: the profile's workload, greedy, ignore_eos, all in one generate call."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.ab_driver import ABDriver, ABWorkload, Variant
from benchmarks.workload import BenchRequest


@dataclass(frozen=True)
class PrecisionOptions:
    model: str
    kv_cache_memory: str = "2GiB"
    rounds: int = 2


def run_precision(requests: list[BenchRequest], options: PrecisionOptions) -> dict:
    workload = ABWorkload("default", requests)
    driver = ABDriver(options.model, [workload], options.rounds, "float32", options.kv_cache_memory)
    runs = driver.run([Variant(d, {"dtype": d}, {"dtype": d}) for d in ("float32", "bfloat16")])
    return {"requests": len(requests), "rounds": options.rounds, "runs": runs}
