"""The Executor protocol: what the engine core needs from its worker(s).

`describe()` and `initialize_cache(...)` run once when an engine core is built
(engine_core_builder.py); `execute(plan)` returns at once with a future of the
RunnerOutput, so up to `max_concurrent_batches` plans are in flight (vLLM's batch queue);
`failed` says between steps whether the workers are already lost.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.common.worker_info import CacheInfo, ModelInfo


class WorkerStepError(RuntimeError):
    """A worker could not run a plan (the scheduler and the worker disagree)."""


class Executor(Protocol):
    """`max_concurrent_batches` is `pp` under pipeline parallelism, 2 under async
    scheduling, else 1. Plans run on the workers in the order they were submitted. A failed
    step sets the future's exception: ConnectionError (a worker is gone), TimeoutError, or
    WorkerStepError (a worker rejected the plan), each naming the rank and address where it
    has them.
    """

    # How many plans the step loop may keep in flight at once (>= 1).
    max_concurrent_batches: int

    @property
    def failed(self) -> BaseException | None:
        """Why the workers are lost, or None while they are there."""
        ...

    def describe(self) -> ModelInfo: ...

    def initialize_cache(
        self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> CacheInfo: ...

    def execute(self, plan: SchedulerOutput) -> Future[RunnerOutput]: ...

    def close(self) -> None: ...
