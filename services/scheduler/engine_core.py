"""EngineCore: the scheduler's step loop over an executor (in-process or gRPC workers).

Up to `executor.max_concurrent_batches` plans are in flight at once (the batch queue): with
room in the queue and something to schedule, a step plans and submits without waiting;
otherwise it waits for the oldest plan in flight and processes its output. Depth 1 is the
synchronous loop (schedule, execute, update in one step); depth 2 with one worker is async
scheduling (the next plan is made while the worker runs the current one). The scheduler
never schedules a request whose step is in flight, so outputs never depend on the depth.
"""

from __future__ import annotations

import logging

from services.common.engine_output import EngineCoreOutputs
from services.common.engine_request import EngineCoreRequest
from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.batch_queue import BatchQueue
from services.scheduler.executor.executor import Executor
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def carries_nothing(plan: SchedulerOutput) -> bool:
    """A plan with no tokens to run and nothing for the worker to apply."""
    return plan.is_empty and not (
        plan.finished_req_ids
        or plan.blocks_to_copy
        or plan.blocks_to_swap_in
        or plan.blocks_to_swap_out
        or plan.kv_drops
        or plan.kv_loads
        or plan.kv_saves
    )


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.batch_queue = BatchQueue(executor.max_concurrent_batches)
        self.num_steps = 0  # plans submitted to the executor

    def add_request(self, request: EngineCoreRequest, client_id: int = 0) -> Request:
        """Admit a request from client `client_id` (its outputs go back to that client);
        raises RequestRejectedError (a ValueError) saying why not. The one place an
        EngineCoreRequest becomes the scheduler's Request."""
        admitted = Request.from_engine_request(request, self.scheduler.block_size)
        admitted.client_id = client_id
        self.scheduler.add_request(admitted)
        return admitted

    def abort_requests(self, request_ids: list[str], client_id: int | None = None) -> None:
        """Abort now (only `client_id`'s requests when given); an aborted request's step
        still in flight is ignored when it lands."""
        self.scheduler.abort_requests(request_ids, client_id)

    def has_work(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self.scheduler.has_pending_outputs()
            or len(self.batch_queue) > 0
        )

    def step(self) -> dict[int, EngineCoreOutputs]:
        """One turn of the loop; outputs per client id (empty while the queue fills).

        Submits a plan when the queue has room and something is schedulable, and returns
        at once if there is room for more; otherwise waits for the oldest plan in flight
        and processes its output. Never spins: a step that submits nothing waits. An
        executor failure (the future's exception) propagates out of step().
        """
        if len(self.batch_queue) == 0 and not self.scheduler.has_unfinished_requests():
            return self.scheduler.update_from_output(SchedulerOutput(), RunnerOutput())
        submitted = self._may_schedule() and self._submit(self.scheduler.schedule())
        if submitted and self._may_schedule():
            return {}  # room for another plan: fill the queue before waiting
        return self._process_oldest()

    def _may_schedule(self) -> bool:
        if len(self.batch_queue) == 0:
            return self.scheduler.has_unfinished_requests()
        return self.batch_queue.has_room and self.scheduler.has_schedulable_requests()

    def _submit(self, plan: SchedulerOutput) -> bool:
        """Hand the plan to the executor; a plan that carries nothing is dropped while
        others are in flight (it would only take a slot). True if submitted."""
        if len(self.batch_queue) > 0 and carries_nothing(plan):
            return False
        self.batch_queue.push(plan, self.executor.execute(plan))
        self.num_steps += 1
        return True

    def _process_oldest(self) -> dict[int, EngineCoreOutputs]:
        in_flight = self.batch_queue.pop_oldest()
        result = in_flight.future.result()
        return self.scheduler.update_from_output(in_flight.plan, result)
