"""The scheduler's side of a pooling request: a prefill that samples nothing, planned
without sampling params, finished when the worker's final pooled vector arrives (passed
on as it is: no adding, no dividing), and failed when its prompt is done without one."""

from __future__ import annotations

import numpy as np

from services.common.config import CacheConfig, SchedulerConfig
from services.common.pooler_config import PoolerConfig
from services.common.pooling_params import PoolingParams
from services.common.runner_output import RunnerOutput
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

VECTOR = np.array([0.5, -0.25, 0.125], np.float32)


def _scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=4),
        CacheConfig(block_size=4),
        num_device_blocks=16,
        pooler=PoolerConfig(pooling_type="MEAN", normalize=True, hidden_size=3),
    )


def _step(scheduler: Scheduler, pooled: dict | None = None):
    plan = scheduler.schedule()
    ids = list(plan.num_scheduled_tokens)
    output = RunnerOutput(ids, [[] for _ in ids], pooled=pooled or {})
    return plan, scheduler.update_from_output(plan, output)


def test_a_chunked_pooling_request_forwards_the_workers_final_vector():
    scheduler = _scheduler()
    scheduler.add_request(Request("p", list(range(1, 11)), pooling_params=PoolingParams()))
    plan, outputs = _step(scheduler)
    (new,) = plan.scheduled_new_reqs
    assert new.kind == PoolingParams()
    assert plan.num_scheduled_tokens == {"p": 4} and outputs == {}
    plan, outputs = _step(scheduler)
    assert plan.num_scheduled_tokens == {"p": 4} and outputs == {}
    plan, outputs = _step(scheduler, {"p": VECTOR})
    assert plan.num_scheduled_tokens == {"p": 2}
    (out,) = outputs[0].outputs
    assert out.finish_reason == "stop" and out.pooled is VECTOR  # forwarded, untouched
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.num_free_blocks == 16


def test_a_prompt_done_without_a_pooled_vector_fails_its_request():
    scheduler = _scheduler()
    scheduler.add_request(Request("p", [1, 2, 3], pooling_params=PoolingParams()))
    _, outputs = _step(scheduler)
    (out,) = outputs[0].outputs
    assert out.finish_reason == "error" and out.pooled is None
    assert "no pooled vector" in out.error
    assert scheduler.kv.num_free_blocks == 16
