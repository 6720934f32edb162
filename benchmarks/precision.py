"""`pagestream bench precision`: bfloat16 against float32 on the CPU, side by side: the
profile's workload (greedy, ignore_eos, every request in one generate call) on the A/B
driver (benchmarks/ab_driver.py), float32 the baseline of each row's ratios and agreement."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.ab_driver import ABDriver
from benchmarks.ab_workload import ABWorkload
from benchmarks.variant import Variant
from benchmarks.workload import BenchRequest

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PrecisionOptions:
    model: str
    kv_cache_memory: str = "2GiB"
    rounds: int = 2


def run_precision(requests: list[BenchRequest], options: PrecisionOptions) -> dict:
    workload = ABWorkload("default", requests)
    driver = ABDriver(options.model, [workload], options.rounds, "float32", options.kv_cache_memory)
    runs = driver.run([Variant(d, {"dtype": d}, {"dtype": d}) for d in DTYPES])
    return {"requests": len(requests), "rounds": options.rounds, "runs": runs}
