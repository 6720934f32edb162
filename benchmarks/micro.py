"""Calls timed in interleaved rounds (a noisy stretch hits them all alike), and the machine's
read bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each call in each of ``rounds`` rounds, after one warm-up round."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(rounds + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if round_index:  # round 0 warms up
                samples[name].append(time.perf_counter() - start)
    return samples


def read_bandwidth_gb_s(gib: float = 1.0, rounds: int = 5) -> float:
    """Median GB/s of summing a float32 tensor far bigger than the caches, on torch's threads."""
    import torch

    data = torch.ones(int(gib * 2**30) // 4)
    seconds = interleaved({"sum": data.sum}, rounds)["sum"]
    return data.numel() * 4 / statistics.median(seconds) / 1e9
