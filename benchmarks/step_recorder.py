"""Per-step timings of an engine's run, from the scheduler's side of the executor.

Wraps ``engine.core.executor.execute`` (every plan goes through it, in process or to a worker
group): per plan its size, the wall time from submission until its result landed, and the
output rank's own prepare / forward / sample (services/common/runner_output.py); wall minus
the worker's time is the transport's (gRPC, the other ranks, a queue behind an earlier plan).
"""

from __future__ import annotations

import contextlib
import operator
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    num_tokens: int
    num_seqs: int
    decode: bool  # every scheduled sequence ran one token
    wall_s: float  # submitted -> result landed (scheduler side)
    prepare_s: float
    forward_s: float
    sample_s: float
    tag: object = None  # what the caller attached the recorder with (a round, say)

    @property
    def worker_s(self) -> float:
        return self.prepare_s + self.forward_s + self.sample_s


class StepRecorder:
    """Records accumulate over every engine it is attached to (one per round)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    @contextlib.contextmanager
    def attached(self, engine, tag: object = None) -> Iterator[StepRecorder]:
        """Record every plan ``engine`` (an LLMEngine) runs inside the block, tagged ``tag``."""
        executor = engine.core.executor
        execute = executor.execute

        def recorded(plan):
            start = time.perf_counter()
            future = execute(plan)
            if plan.total_num_scheduled_tokens:
                future.add_done_callback(lambda f: self._record(plan, start, f, tag))
            return future

        executor.execute = recorded
        try:
            yield self
        finally:
            del executor.execute  # back to the class's method

    def _record(self, plan, start: float, future, tag: object) -> None:
        wall = time.perf_counter() - start
        if future.exception() is not None:
            return
        t = future.result().timings
        counts = plan.num_scheduled_tokens.values()
        decode = all(c == 1 for c in counts)
        sizes = (plan.total_num_scheduled_tokens, len(counts), decode, wall)
        self.records.append(StepRecord(*sizes, t.prepare_s, t.forward_s, t.sample_s, tag))

    def summary(self, estimates: dict[str, Callable] | None = None, tag: object = None) -> dict:
        """summarize_steps over the decode-only steps and over those with a prefill in them
        (of the records tagged ``tag``, or all)."""
        records = [r for r in self.records if tag is None or r.tag == tag]
        return {
            "num_steps": len(records),
            "decode": summarize_steps([r for r in records if r.decode], estimates),
            "prefill": summarize_steps([r for r in records if not r.decode], estimates),
            "total_wall_s": round(sum(r.wall_s for r in records), 3),
            "total_forward_s": round(sum(r.forward_s for r in records), 3),
        }


def summarize_steps(
    records: list[StepRecord], estimates: dict[str, Callable[[StepRecord], float]] | None = None
) -> dict:
    """Medians (ms) and totals (s) of the steps' timings; each of ``estimates`` (name -> a
    step's estimated seconds of something, its collectives say) adds ``<name>_ms`` and
    ``total_<name>_s``."""
    if not records:
        return {"num_steps": 0}

    def median_ms(measure) -> float:
        return round(statistics.median(map(measure, records)) * 1e3, 2)

    def total_s(measure) -> float:
        return round(sum(map(measure, records)), 3)

    names = ("wall", "worker", "prepare", "forward", "sample")
    measures = {name: operator.attrgetter(f"{name}_s") for name in names}
    measures["transport"] = lambda r: r.wall_s - r.worker_s
    summary = {
        "num_steps": len(records),
        "median_tokens": statistics.median(r.num_tokens for r in records),
        "median_seqs": statistics.median(r.num_seqs for r in records),
    }
    summary |= {f"{name}_ms": median_ms(measure) for name, measure in measures.items()}
    summary |= {f"total_{name}_s": total_s(measures[name]) for name in ("wall", "forward")}
    for name, estimate in (estimates or {}).items():
        summary |= {f"{name}_ms": median_ms(estimate), f"total_{name}_s": total_s(estimate)}
    return summary
