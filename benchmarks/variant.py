"""Variant: one configuration of an A/B benchmark (benchmarks/ab_driver.py): the engine
arguments it adds to the driver's, the adapters its requests are spread over, the batches
and workloads it runs, and what its rows say about it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Variant:
    label: str
    engine: dict = field(default_factory=dict)  # LLM(...) arguments over the driver's
    facts: dict = field(default_factory=dict)  # its rows' extras: what it is (method, rank)
    adapters: tuple = ()  # LoRARequests spread round-robin over the requests
    batches: tuple[int | None, ...] | None = None  # only these batches (None: the workload's)
    workloads: tuple[str, ...] | None = None  # only these workloads (None: every one)

    def runs(self, workload) -> bool:
        return self.workloads is None or workload.name in self.workloads

    def batches_of(self, workload) -> tuple[int | None, ...]:
        return self.batches or workload.batches

    def spread(self, count: int, most: int | None = None) -> list:
        """Request i's adapter: adapters[i mod n] of the first `most` (None for every
        request where the variant has none)."""
        adapters = self.adapters[:most] if most else self.adapters
        return [adapters[i % len(adapters)] if adapters else None for i in range(count)]
