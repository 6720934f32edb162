"""The results model: one engine's run (RunResult), the figures drawn from runs (percentiles,
medians, ratios, greedy agreement), the machine, and results.json (every section's results)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class RunResult:
    """One engine's run over a workload; tokens are the useful ones (per-request lengths)."""

    name: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    generated_tokens: int  # including a static batch's padding rows and steps
    extra: dict
    # each request's output token ids where the run kept them (not in as_dict)
    token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, name: str, requests, elapsed_s: float, *, generated: int, **kwargs) -> RunResult:
        """A run over ``requests`` that generated ``generated`` tokens (all useful by default)."""
        kwargs = {"output_tokens": generated, "extra": {}, **kwargs}
        prompt_tokens = sum(r.prompt_len for r in requests)
        return cls(
            name, elapsed_s, len(requests), prompt_tokens, generated_tokens=generated, **kwargs
        )

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "elapsed_s": round(self.elapsed_s, 3),
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "generated_tokens": self.generated_tokens,
            "requests_per_s": round(self.requests_per_s, 4),
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
            "total_tokens_per_s": round(self.total_tokens_per_s, 2),
            **self.extra,
        }


def percentiles(
    values, points=(50, 99), *, scale: float = 1.0, digits: int = 1, mean: bool = False
) -> dict:
    """{"p50": ..., "p99": ...} (and "mean") of ``values`` times ``scale``, rounded (None: none)."""
    array = np.asarray(list(values), dtype=float) * scale
    keys = [f"p{p}" for p in points] + ["mean"] * mean
    if not array.size:
        return dict.fromkeys(keys)
    out = {f"p{p}": round(float(np.percentile(array, p)), digits) for p in points}
    if mean:
        out["mean"] = round(float(array.mean()), digits)
    return out


def median(values, digits: int = 3) -> float | None:
    """The median of the values that are there (None where none is)."""
    present = [v for v in values if v is not None]
    return round(float(statistics.median(present)), digits) if present else None


def ratio(a: float | None, b: float | None, digits: int = 3) -> float | None:
    return round(a / b, digits) if a is not None and b else None


def rotated(items, round_index: int) -> list:
    """``items`` rotated by one each round: none always runs first or after the same one."""
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]


def first_difference(got: list[int], reference: list[int]) -> int:
    """The index of the first differing token (the shorter length when one is a prefix)."""
    for i, (a, b) in enumerate(zip(got, reference, strict=False)):
        if a != b:
            return i
    return min(len(got), len(reference))


def agreement(got: list[list[int]], reference: list[list[int]]) -> dict:
    """Greedy agreement with ``reference``: requests equal all the way, first differences."""
    firsts = [first_difference(g, r) for g, r in zip(got, reference, strict=True)]
    return {
        "requests": len(reference),
        "equal": sum(g == r for g, r in zip(got, reference, strict=True)),
        "mean_first_difference": round(statistics.mean(firsts), 2) if firsts else 0.0,
        "mean_output_len": round(statistics.mean(map(len, reference)), 2) if reference else 0.0,
    }


def load_average(run, *args, **kwargs) -> dict:
    """``run(*args, **kwargs)``'s results with the load average before and after it."""
    start = os.getloadavg()[0]
    result = run(*args, **kwargs)
    end = os.getloadavg()[0]
    return {**result, "load_average": {"start": round(start, 2), "end": round(end, 2)}}


def machine_info() -> dict:
    import torch
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    names = re.findall(r"^model name[^:]*:(.*)$", info.read_text() if info.exists() else "", re.M)
    return names[0].strip() if names else platform.processor() or platform.machine()


def part_of(results: dict, key: str, part: str | None = None) -> dict:
    """A section's results under ``key`` (its ``part``'s, where given); {} where none."""
    found = results.get(key) or {}
    return (found.get(part) or {}) if part else found


def load_results(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def save_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
