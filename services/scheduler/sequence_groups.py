"""SequenceGroups: requests that become several sequences on shared KV blocks.

- n > 1 (parallel sampling): the prompt is prefilled once, then forked into n sequences
  that share its blocks (copy-on-write on the partial block); child i samples with seed+i.
- Beam search: every live beam is a sequence; after each step the next beams are forked
  from their parents' blocks and the pruned beams are freed (see beam_search.py).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from services.common.engine_output import EngineCoreOutput
from services.common.runner_output import TokenLogprobs
from services.scheduler.beam_search import BeamGroup, NextBeam
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus


class SequenceQueues(Protocol):
    """What sequence groups need of their scheduler (the Scheduler is one): its request
    table and queues, its KV cache manager, and a way to end a sequence silently."""

    requests: dict[str, Request]
    running: list[Request]
    waiting: deque[Request]
    kv: KVCacheManager

    def retire(self, request: Request) -> None: ...


def _derived(parent: Request, request_id: str, **fields) -> Request:
    """A sequence of the same group: same prompt, arrival, client and priority."""
    return Request(
        request_id=request_id,
        prompt_token_ids=parent.prompt_token_ids,
        eos_token_id=parent.eos_token_id,
        arrival_time=parent.arrival_time,
        priority=parent.priority,
        cache_salt=parent.cache_salt,
        lora_request=parent.lora_request,
        client_id=parent.client_id,
        parent_request_id=parent.group_id,
        num_cached_tokens=parent.num_cached_tokens,
        block_size=parent.block_size,
        first_scheduled_time=parent.first_scheduled_time,
        **fields,
    )


class SequenceGroups:
    def __init__(self, scheduler: SequenceQueues) -> None:
        self.scheduler = scheduler
        self.beam_groups: dict[str, BeamGroup] = {}

    # ---- parallel sampling ---------------------------------------------------------
    def fork(self, parent: Request) -> None:
        """Split a prefilled n > 1 request into n running sequences sharing its blocks."""
        s = self.scheduler
        parent.pending_fork = False
        params = parent.sampling_params
        position = s.running.index(parent) + 1
        for index in range(1, params.n):
            seed = None if params.seed is None else params.seed + index
            child = _derived(
                parent,
                f"{parent.request_id}#{index}",
                sampling_params=params.clone(n=1, seed=seed),
                index=index,
                num_computed_tokens=parent.num_computed_tokens,
                status=RequestStatus.RUNNING,
            )
            s.requests[child.request_id] = child
            s.kv.fork(parent, child)
            s.structured.fork(parent, child)
            s.running.insert(position + index - 1, child)
        parent.parent_request_id = parent.request_id

    # ---- beam search ---------------------------------------------------------------
    def add_beam_request(self, request: Request, max_model_len: int) -> None:
        params = request.sampling_params
        eos = set(params.all_stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            eos.add(request.eos_token_id)
        max_tokens = params.max_tokens or max_model_len - request.num_prompt_tokens
        group = BeamGroup(
            request.request_id,
            params.n,
            max_tokens,
            params.length_penalty,
            frozenset(eos),
            request.client_id,
        )
        request.sampling_params = params.clone()
        # The worker returns the top-K logprobs each beam needs (K may exceed the user cap).
        request.sampling_params.logprobs = group.num_candidates
        request.parent_request_id = request.request_id
        request.beam_group = request.request_id
        group.start(request.request_id)
        self.beam_groups[request.request_id] = group

    def on_beam_output(
        self, request: Request, logprobs: list[TokenLogprobs] | None
    ) -> list[EngineCoreOutput]:
        """A beam's step result; advances its group once every live beam has reported."""
        group = self.beam_groups.get(request.beam_group or "")
        if group is None or not logprobs:
            return []  # a middle prefill chunk, or a group already gone
        if not group.report(request.request_id, logprobs[0]):
            return []
        return self._advance(group)

    def _advance(self, group: BeamGroup) -> list[EngineCoreOutput]:
        s = self.scheduler
        beams = [s.requests[beam_id] for beam_id in group.live]
        step = group.advance({b.request_id: b.output_token_ids for b in beams})
        children = [
            self._spawn(group, s.requests[nb.parent_id], nb, j)
            for j, nb in enumerate(step.next_beams)
        ]
        in_running = [s.running.index(b) for b in beams if b in s.running]
        position = min(in_running, default=len(s.running))
        for beam in beams:
            s.retire(beam)
        s.running[position:position] = [c for c in children if c.status == RequestStatus.RUNNING]
        group.live = {
            c.request_id: nb.cumulative_logprob
            for c, nb in zip(children, step.next_beams, strict=True)
        }
        if not step.done:
            return []
        return self._final_outputs(group, beams[0])

    def _spawn(self, group: BeamGroup, parent: Request, beam: NextBeam, j: int) -> Request:
        child = _derived(
            parent,
            f"{group.group_id}~{group.num_steps}.{j}",
            sampling_params=parent.sampling_params,
            output_token_ids=[*parent.output_token_ids, beam.token_id],
        )
        child.beam_group = group.group_id
        s = self.scheduler
        s.requests[child.request_id] = child
        if parent.status == RequestStatus.RUNNING:
            child.status = RequestStatus.RUNNING
            child.num_computed_tokens = parent.num_computed_tokens
            s.kv.fork(parent, child)
        else:  # the parent lost its blocks to a preemption: the child recomputes
            child.status = RequestStatus.PREEMPTED
            s.waiting.appendleft(child)
        return child

    def _final_outputs(self, group: BeamGroup, any_beam: Request) -> list[EngineCoreOutput]:
        del self.beam_groups[group.group_id]
        return [
            EngineCoreOutput(
                request_id=group.group_id,
                new_token_ids=hyp.token_ids,
                finish_reason="stop" if hyp.ended_with_eos else "length",
                num_cached_tokens=any_beam.num_cached_tokens,
                parent_request_id=group.group_id,
                index=index,
                cumulative_logprob=hyp.cumulative_logprob,
            )
            for index, hyp in enumerate(group.finished)
        ]

    def abort_beam_group(self, group_id: str) -> list[EngineCoreOutput]:
        """Free every live beam; one abort output per returned sequence."""
        group = self.beam_groups.pop(group_id, None)
        if group is None:
            return []
        for beam_id in list(group.live):
            beam = self.scheduler.requests.get(beam_id)
            if beam is not None:
                self.scheduler.retire(beam)
        return [
            EngineCoreOutput(group_id, [], "abort", parent_request_id=group_id, index=i)
            for i in range(group.beam_width)
        ]
