"""BatchQueue: the plans in flight on the executor, oldest first (vLLM's batch queue).

The step loop submits a plan and keeps it here with the future of its RunnerOutput until
it takes the oldest back to wait for that output. It holds at most `max_size` plans (the
executor's `max_concurrent_batches`: `pp` for pipeline parallelism, 2 for async scheduling,
1 for the synchronous loop). Plans run on the workers in submission order, so the oldest
plan's output is always the next one to process.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class PlanInFlight:
    plan: SchedulerOutput
    future: Future[RunnerOutput]


class BatchQueue:
    def __init__(self, max_size: int) -> None:
        if max_size < 1:
            raise ValueError(f"the batch queue needs room for at least 1 plan, got {max_size}.")
        self.max_size = max_size
        self._plans: deque[PlanInFlight] = deque()

    def __len__(self) -> int:
        return len(self._plans)

    @property
    def has_room(self) -> bool:
        return len(self._plans) < self.max_size

    def push(self, plan: SchedulerOutput, future: Future[RunnerOutput]) -> None:
        """Add a submitted plan; raises RuntimeError when the queue is already full."""
        if not self.has_room:
            raise RuntimeError(f"the batch queue is full ({self.max_size} plans in flight).")
        self._plans.append(PlanInFlight(plan, future))

    def pop_oldest(self) -> PlanInFlight:
        """Take the oldest plan out; raises IndexError when none is in flight."""
        if not self._plans:
            raise IndexError("no plan is in flight.")
        return self._plans.popleft()
