"""A deterministic executor over the stand-in worker that keeps plans really in flight.

`execute(plan)` only queues the plan; the worker runs queued plans in submission order
when the engine core asks for a result (or at once, with `eager=True`), so a later plan is
always scheduled while earlier ones are still outstanding, with no threads and no timing.
It checks the batch-queue contract as it goes: never more than `max_concurrent_batches`
plans outstanding, and never one request in two outstanding plans.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from tests.scheduler.stand_in_worker import StandInWorker


class _StepFuture(Future):
    """Runs the worker up to its plan when its result is asked for."""

    def __init__(self, executor: StandInExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> RunnerOutput:
        self._executor.run_until(self)
        self._executor.outstanding.pop(self, None)
        return super().result(timeout)


class StandInExecutor:
    def __init__(
        self,
        worker: StandInWorker,
        max_concurrent_batches: int = 1,
        eager: bool = False,
        fail_at_plan: int | None = None,
    ) -> None:
        self.worker = worker
        self.max_concurrent_batches = max_concurrent_batches
        self.eager = eager
        self.fail_at_plan = fail_at_plan  # index of the plan whose step raises
        self.queued: deque[tuple[SchedulerOutput, _StepFuture]] = deque()
        self.outstanding: dict[_StepFuture, set[str]] = {}  # result not taken yet
        self.num_plans = 0
        self.max_outstanding = 0
        self.failed: BaseException | None = None  # the Executor protocol: never lost here

    def execute(self, plan: SchedulerOutput) -> Future[RunnerOutput]:
        ids = set(plan.num_scheduled_tokens)
        for other in self.outstanding.values():
            assert not ids & other, f"{sorted(ids & other)} in two plans in flight"
        assert len(self.outstanding) < self.max_concurrent_batches, "the batch queue overflowed"
        future = _StepFuture(self)
        self.outstanding[future] = ids
        self.max_outstanding = max(self.max_outstanding, len(self.outstanding))
        self.queued.append((plan, future))
        if self.eager:
            self.run_until(future)
        return future

    def run_until(self, future: Future) -> None:
        """Run queued plans in submission order until this future has its result."""
        while not future.done() and self.queued:
            plan, pending = self.queued.popleft()
            index, self.num_plans = self.num_plans, self.num_plans + 1
            if index == self.fail_at_plan:
                pending.set_exception(ConnectionError(f"stand-in worker gone at plan {index}"))
                continue
            pending.set_result(self.worker.execute(plan))

    def close(self) -> None:
        self.queued.clear()
