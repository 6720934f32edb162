"""Per-step timings of an engine's run, from the scheduler's side of the executor.

The recorder wraps ``engine.core.executor.execute`` (the one call every plan goes through,
in process or to a worker group): for each plan it keeps its size (tokens, sequences,
decode-only or not), the wall time from submission until its result landed, and the output
rank's own timings (prepare / forward / sample, services/common/runner_output.py). Under
tensor parallelism the output rank's forward time includes its waits in every all-reduce;
under pipeline parallelism it is the last stage's forward, its wait for the previous stage
included. Wall minus the worker's own time is what the transport costs (gRPC, the other
ranks' acknowledgements, the queue behind an earlier plan when plans overlap).
"""

from __future__ import annotations

import contextlib
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
        """Record every plan ``engine`` (a pagestream LLMEngine) runs inside the block,
        each record tagged with ``tag``."""
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
        timings = future.result().timings
        counts = plan.num_scheduled_tokens.values()
        self.records.append(
            StepRecord(
                num_tokens=plan.total_num_scheduled_tokens,
                num_seqs=len(counts),
                decode=all(c == 1 for c in counts),
                wall_s=wall,
                prepare_s=timings.prepare_s,
                forward_s=timings.forward_s,
                sample_s=timings.sample_s,
                tag=tag,
            )
        )

    def summary(
        self,
        estimates: dict[str, Callable[[StepRecord], float]] | None = None,
        tag: object = None,
    ) -> dict:
        """Medians (ms) over decode-only steps and over steps with a prefill in them (of
        the records tagged ``tag``, or all); each of ``estimates`` (name -> a step's
        estimated seconds of something, such as its collectives) adds ``<name>_ms``, its
        median, and ``total_<name>_s``."""
        records = [r for r in self.records if tag is None or r.tag == tag]
        decode = [r for r in records if r.decode]
        prefill = [r for r in records if not r.decode]
        return {
            "num_steps": len(records),
            "decode": summarize_steps(decode, estimates),
            "prefill": summarize_steps(prefill, estimates),
            "total_wall_s": round(sum(r.wall_s for r in records), 3),
            "total_forward_s": round(sum(r.forward_s for r in records), 3),
        }


def summarize_steps(
    records: list[StepRecord], estimates: dict[str, Callable[[StepRecord], float]] | None = None
) -> dict:
    if not records:
        return {"num_steps": 0}

    def median_ms(values) -> float:
        return round(statistics.median(values) * 1e3, 2)

    summary = {
        "num_steps": len(records),
        "median_tokens": statistics.median(r.num_tokens for r in records),
        "median_seqs": statistics.median(r.num_seqs for r in records),
        "wall_ms": median_ms(r.wall_s for r in records),
        "worker_ms": median_ms(r.worker_s for r in records),
        "prepare_ms": median_ms(r.prepare_s for r in records),
        "forward_ms": median_ms(r.forward_s for r in records),
        "sample_ms": median_ms(r.sample_s for r in records),
        "transport_ms": median_ms(r.wall_s - r.worker_s for r in records),
        "total_wall_s": round(sum(r.wall_s for r in records), 3),
        "total_forward_s": round(sum(r.forward_s for r in records), 3),
    }
    for name, estimate in (estimates or {}).items():
        summary[f"{name}_ms"] = median_ms(estimate(r) for r in records)
        summary[f"total_{name}_s"] = round(sum(estimate(r) for r in records), 3)
    return summary
