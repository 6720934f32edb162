"""The Pooler over the InputBatch's pooled states: a chunked prompt is read chunk by chunk
and its vector comes back once, final, in the step that ends the prompt; a recompute
preemption starts the state again, a swap keeps it; a chunk that does not continue the
state fails only its request. Hidden states are a fixed table by prompt position, so the
expected vectors are plain numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.pooler_config import PoolerConfig
from services.common.pooling_params import PoolingParams
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.worker.input_batch import InputBatch
from services.worker.pooler import Pooler

HIDDEN = 8
PROMPT = list(range(10, 20))  # 10 tokens
TABLE = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(0))  # [pos, hidden]
ENCODE = PoolingParams(task="encode")


def _new(rid, params=ENCODE, computed=0, prompt=PROMPT) -> NewRequestData:
    return NewRequestData(rid, list(prompt), [], params, ([1, 2, 3],), computed)


def _plan(scheduled, new=(), cached=(), finished=()) -> SchedulerOutput:
    """cached: (request_id, num_computed_tokens, resumed) tuples."""
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(
            [c[0] for c in cached],
            [([1, 2, 3],) if c[2] else ([],) for c in cached],
            [c[1] for c in cached],
            [c[2] for c in cached],
        ),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(dict(scheduled).values()),
        finished_req_ids=set(finished),
    )


class Worker:
    """An InputBatch and a Pooler, stepped by hand (the rows' hidden states: TABLE)."""

    def __init__(self, pooling_type: str, **config) -> None:
        self.batch = InputBatch(4, 4, 32, 100, None, "cpu")
        # as the worker resolves it: every field set
        config = dict(pooling_type=pooling_type, normalize=True, hidden_size=HIDDEN, **config)
        self.pooler = Pooler(PoolerConfig(**config))

    def step(self, plan: SchedulerOutput):
        """ModelRunner.execute's pooling path: (final vectors, errors)."""
        self.batch.update(plan)
        if plan.is_empty:
            return {}, {}
        inputs = self.batch.prepare(plan)
        return self.pooler.pool(TABLE[inputs.positions], inputs.pooling)


def _mean(n: int = len(PROMPT)) -> np.ndarray:
    return TABLE[:n].mean(dim=0).numpy()


@pytest.mark.parametrize(
    ("kind", "expected"), [("MEAN", _mean()), ("CLS", TABLE[0].numpy()), ("LAST", TABLE[9].numpy())]
)
def test_a_chunked_prompt_is_pooled_once_in_its_last_step(kind, expected):
    worker = Worker(kind)
    assert worker.step(_plan({"p": 4}, new=[_new("p")])) == ({}, {})
    assert worker.step(_plan({"p": 4}, cached=[("p", 4, False)])) == ({}, {})
    pooled, errors = worker.step(_plan({"p": 2}, cached=[("p", 8, False)]))
    assert errors == {} and list(pooled) == ["p"]
    np.testing.assert_allclose(pooled["p"], expected, rtol=1e-6, atol=1e-6)
    whole = Worker(kind).step(_plan({"w": 10}, new=[_new("w")]))[0]["w"]
    np.testing.assert_allclose(pooled["p"], whole, rtol=1e-6, atol=1e-6)


def test_the_worker_truncates_and_normalizes_as_the_request_asks():
    worker = Worker("MEAN", dimensions=4)  # the pooler's default size
    new = [
        _new("embed", PoolingParams()),
        _new("wide", PoolingParams(dimensions=6, normalize=False)),
        _new("raw", ENCODE),
    ]
    pooled, _ = worker.step(_plan({"embed": 10, "wide": 10, "raw": 10}, new=new))
    mean = _mean()
    np.testing.assert_allclose(pooled["embed"], mean[:4] / np.linalg.norm(mean[:4]), rtol=1e-6)
    np.testing.assert_allclose(pooled["wide"], mean[:6], rtol=1e-6)
    np.testing.assert_allclose(pooled["raw"], mean, rtol=1e-6)


def test_a_recompute_preemption_starts_the_pooled_state_again():
    worker = Worker("MEAN")
    worker.step(_plan({"p": 4}, new=[_new("p")]))
    worker.step(_plan({"p": 4}, cached=[("p", 4, False)]))
    # preempted for recompute: dropped on the worker, then sent again in full from 0
    worker.step(_plan({}, finished=["p"]))
    assert worker.step(_plan({"p": 6}, new=[_new("p")])) == ({}, {})
    pooled, errors = worker.step(_plan({"p": 4}, cached=[("p", 6, False)]))
    assert errors == {}
    np.testing.assert_allclose(pooled["p"], _mean(), rtol=1e-6, atol=1e-6)


def test_a_swapped_request_keeps_its_pooled_state():
    worker = Worker("MEAN")
    worker.step(_plan({"p": 4}, new=[_new("p")]))
    worker.step(_plan({}))  # swapped out: not scheduled, still held
    pooled, errors = worker.step(_plan({"p": 6}, cached=[("p", 4, True)]))  # swapped in
    assert errors == {}
    np.testing.assert_allclose(pooled["p"], _mean(), rtol=1e-6, atol=1e-6)


def test_a_chunk_that_does_not_continue_the_state_fails_only_its_request():
    worker = Worker("MEAN")
    gen = NewRequestData("g", [1, 2, 3], [], SamplingParams(), ([4],), 0)
    pooled, errors = worker.step(
        _plan({"gap": 4, "ok": 10, "g": 3}, new=[_new("gap", computed=4), _new("ok"), gen])
    )
    assert list(pooled) == ["ok"]
    assert list(errors) == ["gap"] and "starts at position 4" in errors["gap"]
