"""Scheduler plans built by hand for the worker tests: a new request's data and a
SchedulerOutput from its scheduled token counts (one KV cache group: block ids are lists)."""

from __future__ import annotations

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


def new_req(request_id, prompt, blocks, computed=0, output=(), **params) -> NewRequestData:
    return NewRequestData(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        kind=SamplingParams(**params),
        block_table=(list(blocks),),
        num_computed_tokens=computed,
    )


def plan(scheduled, new=(), cached=(), finished=()) -> SchedulerOutput:
    """cached: (request_id, new_block_ids, num_computed_tokens, resumed) tuples."""
    columns = list(zip(*cached, strict=True)) if cached else [[], [], [], []]
    request_ids, new_block_ids, num_computed, resumed = [list(c) for c in columns]
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(
            request_ids, [(list(ids),) for ids in new_block_ids], num_computed, resumed
        ),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(dict(scheduled).values()),
        finished_req_ids=set(finished),
    )
