"""StepsInFlight: which requests (and sequence groups) have a step on the workers now.

A request is in flight from the plan that schedules it until that plan's output is
processed (or the request ends); `groups` counts in-flight sequences per group (n > 1,
beam search), with no zero entries, so "is any member in flight" is a dict lookup.
"""

from __future__ import annotations

from collections import Counter

from services.common.scheduler_output import SchedulerOutput
from services.scheduler.request import Request


class StepsInFlight:
    def __init__(self) -> None:
        self.groups: Counter[str] = Counter()  # group_id -> sequences in flight

    def take_off(self, request: Request, plan: SchedulerOutput) -> None:
        request.step_in_flight = plan
        self.groups[request.group_id] += 1

    def clear(self, request: Request) -> None:
        if request.step_in_flight is None:
            return
        request.step_in_flight = None
        group_id = request.group_id
        self.groups[group_id] -= 1
        if self.groups[group_id] <= 0:
            del self.groups[group_id]

    def land(self, plan: SchedulerOutput, requests: dict[str, Request]) -> dict[str, Request]:
        """The plan's step is back: its live requests, no longer in flight, by id."""
        landed = {}
        for rid in plan.num_scheduled_tokens:
            request = requests.get(rid)
            if request is not None and request.step_in_flight is plan:
                self.clear(request)
                landed[rid] = request
        return landed

    def blocks(self, request: Request) -> bool:
        """It, or a sequence of its group, has a step in flight."""
        return request.group_id in self.groups
