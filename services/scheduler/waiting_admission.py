"""WaitingAdmission: the Scheduler's waiting queue, head first, into the step's plan.

A mixin of `Scheduler` (services/scheduler/scheduler.py), which owns the queues, the KV
cache manager and the plan helpers it calls: the head of the queue is admitted while the
budget, max_num_seqs and free blocks allow; a request whose grammar still compiles is
passed over (others go first) and put back at the head afterwards; a request that can
never fit, or whose grammar failed, ends here with its final output.
"""

from __future__ import annotations

from collections import deque

from services.scheduler.kv_cache_manager import KVCacheManager, cdiv
from services.scheduler.plan_builder import PlanBuilder
from services.scheduler.request import Request, RequestStatus


class WaitingAdmission:
    waiting: deque[Request]
    running: list[Request]
    kv: KVCacheManager

    def _schedule_waiting(self, plan: PlanBuilder) -> None:
        compiling: list[Request] = []  # passed over while their grammars compile
        try:
            while self.waiting and plan.token_budget > 0:
                request = self.waiting[0]
                if (status := self.structured.gate(request)) is not None:
                    if status.is_finished:  # its grammar failed, or allows only EOS
                        self._finish_waiting(status)
                    else:  # still compiling: others go first
                        compiling.append(self.waiting.popleft())
                    continue
                if len(self.running) + request.sampling_params.n > self.config.max_num_seqs:
                    return
                if self.is_blocked(request):
                    return  # a sibling's step is in flight: the queue moves next step
                if cdiv(request.num_tokens, self.block_size) > self.kv.num_blocks:
                    self._finish_waiting(RequestStatus.FINISHED_IGNORED)
                    continue
                if not self._admit(request, plan):
                    return
        finally:
            self.waiting.extendleft(reversed(compiling))

    def _finish_waiting(self, status: RequestStatus) -> None:
        """End the head of the waiting queue (its final output goes with the next step)."""
        request = self.waiting.popleft()
        self._finish(request, status)
        self.pending_outputs.append((request.client_id, request.to_output([])))

    def _admit(self, request: Request, plan: PlanBuilder) -> bool:
        computed_blocks, num_hit = self.kv.get_computed_blocks(request)
        target = request.num_prompt_tokens - 1 if request.pending_fork else request.num_tokens
        num_new = max(target - num_hit, 0)
        if not self.config.enable_chunked_prefill and num_new > plan.token_budget:
            return False  # strict FCFS: nothing behind it may overtake
        num_new = self._num_new_tokens(num_new, True, plan.token_budget)
        new_blocks = self.kv.allocate_slots(request, num_new, computed_blocks)
        if new_blocks is None:
            return False
        self.waiting.popleft()
        self.kv.record_prefix_query(request.num_tokens, num_hit)
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if num_new:
            self._add_to_plan(plan, request, new_blocks, num_new)
        return True
