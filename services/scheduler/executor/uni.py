"""UniExecutor: one worker in this process (world size 1), run on its own thread.

The worker is any object with `execute(plan) -> RunnerOutput` (services.worker.Worker; the
scheduler never imports it). Plans run one at a time, in submission order, on a single
thread, so the step loop may plan the next step while this one runs.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput


class StepRunner(Protocol):
    def execute(self, plan: SchedulerOutput) -> RunnerOutput: ...

    def describe(self): ...

    def initialize_cache(
        self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int
    ): ...


class UniExecutor:
    def __init__(self, worker: StepRunner, max_concurrent_batches: int = 1) -> None:
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {max_concurrent_batches}.")
        self.worker = worker
        self.max_concurrent_batches = max_concurrent_batches
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagestream-uni")

    @property
    def failed(self) -> BaseException | None:
        return None  # the worker lives in this process: it cannot be lost on its own

    def describe(self):
        """The worker's ModelInfo (the same call a WorkerGroupExecutor answers)."""
        return self.worker.describe()

    def initialize_cache(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int):
        return self.worker.initialize_cache(max_model_len, max_num_seqs, max_num_batched_tokens)

    def execute(self, plan: SchedulerOutput) -> Future[RunnerOutput]:
        return self._thread.submit(self.worker.execute, plan)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        close = getattr(self.worker, "close", None)  # its KV offload files written first
        if close is not None:
            close()
