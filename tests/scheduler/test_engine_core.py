"""The engine core's step loop over the stand-in worker, at batch-queue depths 1 and 2."""

import pytest

from services.scheduler.engine_core import EngineCore
from services.scheduler.executor.uni import UniExecutor
from tests.scheduler.stand_in_worker import make_request, reference_generate

DEPTHS = pytest.mark.parametrize("depth", [1, 2])


@DEPTHS
def test_engine_core_runs_requests_to_completion(build, depth):
    scheduler, worker = build(30, max_num_batched_tokens=64)
    core = EngineCore(scheduler, UniExecutor(worker, depth))
    requests = [make_request(f"r{i}", list(range(i, 20 + 7 * i)), max_tokens=9) for i in range(6)]
    for request in requests:
        core.scheduler.add_request(request)
    finished = {}
    while core.has_work():
        for batch in core.step().values():
            for out in batch.outputs:
                if out.finished:
                    finished[out.request_id] = out.finish_reason
    assert finished == {r.request_id: "length" for r in requests}
    for request in requests:
        assert request.output_token_ids == reference_generate(
            request.prompt_token_ids, request.sampling_params, 2048
        )
    assert core.num_steps > 1
    assert scheduler.kv.num_free_blocks == 30


@DEPTHS
def test_abort_of_waiting_request_reports_final_output(build, depth):
    scheduler, worker = build(30)
    core = EngineCore(scheduler, UniExecutor(worker, depth))
    core.scheduler.add_request(make_request("a", [1, 2, 3]))
    core.abort_requests(["a"])
    outputs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs[0].outputs] == [("a", "abort")]
    assert not core.has_work()


@DEPTHS
def test_a_failing_request_is_aborted_and_the_others_finish(build, monkeypatch, depth):
    """An exception while processing one request's step output ends that request only."""
    scheduler, worker = build(30, max_num_batched_tokens=64)
    core = EngineCore(scheduler, UniExecutor(worker, depth))
    requests = [make_request(f"r{i}", list(range(i, 12 + i)), max_tokens=5) for i in range(3)]
    for request in requests:
        core.scheduler.add_request(request)
    process = scheduler._process_tokens

    def flaky(request, token_ids, plan, runner_output):
        if request.request_id == "r1" and request.num_output_tokens == 2:
            raise OverflowError("bad state in r1")
        return process(request, token_ids, plan, runner_output)

    monkeypatch.setattr(scheduler, "_process_tokens", flaky)
    finished = {}
    while core.has_work():
        for batch in core.step().values():
            finished |= {o.request_id: o.finish_reason for o in batch.outputs if o.finished}
    assert finished == {"r0": "length", "r1": "abort", "r2": "length"}
    assert scheduler.kv.num_free_blocks == 30
