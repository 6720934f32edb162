"""EngineCore: the scheduler's step loop over an executor (in-process or gRPC workers)."""

from __future__ import annotations

import logging

from services.common.engine_output import EngineCoreOutputs
from services.common.engine_request import EngineCoreRequest
from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.scheduler.executor.executor import Executor
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.num_steps = 0

    def add_request(self, request: Request | EngineCoreRequest) -> Request:
        """Admit a request; raises RequestRejectedError (a ValueError) saying why not."""
        if isinstance(request, EngineCoreRequest):
            request = Request.from_engine_request(request, self.scheduler.block_size)
        self.scheduler.add_request(request)
        return request

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_outputs()

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute and update once; outputs per client id."""
        if not self.scheduler.has_unfinished_requests():
            return self.scheduler.update_from_output(SchedulerOutput(), RunnerOutput())
        plan = self.scheduler.schedule()
        result = self.executor.execute(plan).result()
        self.num_steps += 1
        return self.scheduler.update_from_output(plan, result)
