"""The token-budget scheduler driven end to end by the stand-in worker (behaviours 3-9)."""

import pytest

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import RequestRejectedError
from services.scheduler.stop_checker import check_stop
from tests.scheduler.stand_in_worker import (
    EOS_TOKEN_ID,
    make_request,
    reference_generate,
    run_to_completion,
)


def _step(scheduler, worker):
    plan = scheduler.schedule()
    outputs = scheduler.update_from_output(plan, worker.execute(plan))
    return plan, outputs


def test_token_budget_with_prefill_cap(build):
    scheduler, worker = build(200, max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    requests = [make_request(rid, [ord(rid)] * 800, max_tokens=8) for rid in "abc"]
    for request in requests:
        scheduler.add_request(request)
    steps = [_step(scheduler, worker)[0].num_scheduled_tokens for _ in range(3)]
    assert steps[0] == {"a": 400, "b": 400, "c": 224}
    assert steps[1] == {"a": 400, "b": 400, "c": 224}
    # a and b caught up at the end of step 2 and decode; c's remaining prefill shares the step.
    assert steps[2] == {"a": 1, "b": 1, "c": 352}
    run_to_completion(scheduler, worker)
    for request in requests:
        expected = reference_generate(request.prompt_token_ids, request.sampling_params, 2048)
        assert request.output_token_ids == expected and len(expected) == 8


def test_chunked_prefill_off_is_strict_fcfs(build):
    scheduler, worker = build(
        200, max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("a", [1] * 600))
    scheduler.add_request(make_request("b", [2] * 600))
    scheduler.add_request(make_request("c", [3] * 100))
    plan, _ = _step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"a": 600}  # c may not overtake b
    plan, _ = _step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 600, "c": 100}


def test_max_num_seqs_caps_running(build):
    scheduler, worker = build(100, max_num_seqs=2)
    for rid in "abc":
        scheduler.add_request(make_request(rid, [5, 6, 7], max_tokens=4))
    plan, _ = _step(scheduler, worker)
    assert set(plan.num_scheduled_tokens) == {"a", "b"}
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1
    assert set(run_to_completion(scheduler, worker)) == {"a", "b", "c"}


def test_impossible_prompts_are_rejected_without_blocking_the_queue(build):
    scheduler, worker = build(4, max_model_len=100)
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        scheduler.add_request(make_request("long", [1] * 101))
    scheduler_small, _ = build(4, max_model_len=1000)
    with pytest.raises(RequestRejectedError, match=r"needs 5 KV-cache blocks.*holds 4"):
        scheduler_small.add_request(make_request("huge", [1] * 70))
    with pytest.raises(RequestRejectedError, match="empty"):
        scheduler.add_request(make_request("empty", []))
    scheduler.add_request(make_request("ok", [1, 2, 3], max_tokens=5))
    with pytest.raises(RequestRejectedError, match="already in use"):
        scheduler.add_request(make_request("ok", [1, 2, 3]))
    assert len(run_to_completion(scheduler, worker)["ok"]) == 5


def test_length_cap_at_cache_capacity_never_hangs(build):
    scheduler, worker = build(2, block_size=4, max_model_len=100)
    scheduler.add_request(make_request("a", [1] * 6, max_tokens=50, ignore_eos=True))
    outputs = run_to_completion(scheduler, worker)
    assert len(outputs["a"]) == 2  # 8 slots in the whole cache: 6 prompt + 2 generated


def _preemption_workload(scheduler):
    requests = [
        make_request(f"r{i}", [i + 1] * (5 + i), block_size=4, max_tokens=24, ignore_eos=True)
        for i in range(4)
    ]
    for request in requests:
        scheduler.add_request(request)
    return requests


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(build, mode):
    scheduler, worker = build(12, block_size=4, num_cpu_blocks=32, preemption_mode=mode)
    requests = _preemption_workload(scheduler)
    outputs = run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions > 0
    for request in requests:
        expected = reference_generate(request.prompt_token_ids, request.sampling_params, 2048)
        assert outputs[request.request_id] == expected
    if mode == "swap":
        assert any(p.blocks_to_swap_out for p in worker.plans)
        assert any(p.blocks_to_swap_in for p in worker.plans)
    assert scheduler.kv.num_free_blocks == 12
    assert len(scheduler.kv.cpu_free) == 32


def test_recompute_preempts_newest_to_head_of_waiting(build):
    scheduler, worker = build(6, block_size=4)
    for i, rid in enumerate(["old", "new"]):
        scheduler.add_request(make_request(rid, [7 + i] * 8, block_size=4, max_tokens=30))
    scheduler.add_request(make_request("later", [9] * 16, block_size=4, max_tokens=2))
    while scheduler.num_preemptions == 0:
        plan, _ = _step(scheduler, worker)
    assert [r.request_id for r in scheduler.running] == ["old"]
    assert [r.request_id for r in scheduler.waiting] == ["new", "later"]
    assert scheduler.waiting[0].status == RequestStatus.PREEMPTED
    assert scheduler.kv.block_table("new")[0] == []
    assert "new" in plan.finished_req_ids  # the worker drops it; it comes back in full
    assert "new" not in worker.states
    assert len(run_to_completion(scheduler, worker)) == 3


def test_swapped_request_resumes_before_new_requests(build):
    scheduler, worker = build(6, block_size=4, num_cpu_blocks=16, preemption_mode="swap")
    for rid in ["old", "new"]:
        scheduler.add_request(make_request(rid, [7] * 8, block_size=4, max_tokens=12))
    while scheduler.num_preemptions == 0:
        _step(scheduler, worker)
    assert [r.request_id for r in scheduler.swapped] == ["new"]
    scheduler.add_request(make_request("fresh", [3] * 4, block_size=4, max_tokens=2))
    admitted = []
    while scheduler.has_unfinished_requests():
        plan, _ = _step(scheduler, worker)
        if plan.blocks_to_swap_in:
            admitted.append("new")
        if any(r.request_id == "fresh" for r in plan.scheduled_new_reqs):
            admitted.append("fresh")
    assert admitted == ["new", "fresh"]


def test_abort_frees_blocks_and_tells_the_worker(build):
    scheduler, worker = build(10)
    scheduler.add_request(make_request("a", list(range(40)), max_tokens=100))
    _step(scheduler, worker)
    assert scheduler.kv.num_free_blocks == 7
    scheduler.abort_requests(["a"])
    plan, outputs = _step(scheduler, worker)
    assert scheduler.kv.num_free_blocks == 10
    assert plan.finished_req_ids == {"a"}
    assert "a" not in worker.states
    assert outputs[0].outputs[0].finish_reason == "abort"
    assert not scheduler.has_unfinished_requests()


def test_finished_blocks_stay_hittable(build):
    scheduler, worker = build(20)
    scheduler.add_request(make_request("a", list(range(40)), max_tokens=3))
    run_to_completion(scheduler, worker)
    scheduler.add_request(make_request("b", list(range(40)), max_tokens=3))
    plan, outputs = _step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"b": 8}
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 32
    assert outputs[0].outputs[0].num_cached_tokens == 32


def test_stop_checks_in_order():
    def after(tokens, **params):
        request = make_request("x", [1, 2, 3], **params)
        request.output_token_ids = list(tokens)
        return check_stop(request, max_model_len=10), request.stop_reason

    assert after([EOS_TOKEN_ID]) == (RequestStatus.FINISHED_STOPPED, None)
    assert after([EOS_TOKEN_ID], ignore_eos=True) == (None, None)
    assert after([42], stop_token_ids=[42]) == (RequestStatus.FINISHED_STOPPED, 42)
    assert after([5, 6], max_tokens=2) == (RequestStatus.FINISHED_LENGTH_CAPPED, None)
    # EOS on the last allowed token is a stop, not a length cap.
    assert after([5, EOS_TOKEN_ID], max_tokens=2) == (RequestStatus.FINISHED_STOPPED, None)
    assert after([5] * 7, max_tokens=100) == (RequestStatus.FINISHED_LENGTH_CAPPED, None)
    # min_tokens: neither EOS nor stop ids end it early, length caps still do.
    assert after([EOS_TOKEN_ID], min_tokens=2) == (None, None)
    assert after([42], stop_token_ids=[42], min_tokens=2) == (None, None)
    assert after([5, 5, 5], min_tokens=3, max_tokens=3)[0] == RequestStatus.FINISHED_LENGTH_CAPPED


def test_parallel_sampling_shares_prompt_blocks_with_copy_on_write(build):
    scheduler, worker = build(40)
    scheduler.add_request(make_request("g", list(range(40)), n=4, seed=7, max_tokens=6))
    plan, _ = _step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"g": 39}  # one prefill for the group
    plan, _ = _step(scheduler, worker)
    seq_ids = ["g", "g#1", "g#2", "g#3"]
    assert plan.num_scheduled_tokens == dict.fromkeys(seq_ids, 1)
    tables = {rid: scheduler.kv.block_table(rid)[0] for rid in seq_ids}
    shared = tables["g"][:2]
    assert all(t[:2] == shared for t in tables.values())
    assert all(scheduler.kv.pool.blocks[b].ref_cnt == 4 for b in shared)
    # The partial third block was copied for three sequences; the last writes in place.
    assert len(plan.blocks_to_copy) == 3
    assert len({t[2] for t in tables.values()}) == 4
    sequences = [scheduler.requests[rid] for rid in seq_ids]
    run_to_completion(scheduler, worker)
    for index, sequence in enumerate(sequences):
        assert sequence.sampling_params.seed == 7 + index
        expected = reference_generate(list(range(40)), sequence.sampling_params, 2048)
        assert sequence.output_token_ids == expected
        assert sequence.parent_request_id == "g" and sequence.index == index
    assert len({tuple(s.output_token_ids) for s in sequences}) == 4
    assert scheduler.kv.num_free_blocks == 40


def test_aborting_a_group_aborts_every_sequence(build):
    scheduler, worker = build(40)
    scheduler.add_request(make_request("g", list(range(20)), n=3, seed=1, max_tokens=50))
    for _ in range(3):
        _step(scheduler, worker)
    assert len(scheduler.running) == 3
    scheduler.abort_requests(["g"])
    _, outputs = _step(scheduler, worker)
    finals = {(o.request_id, o.finish_reason) for o in outputs[0].outputs}
    assert finals == {("g", "abort"), ("g#1", "abort"), ("g#2", "abort")}
    assert scheduler.kv.num_free_blocks == 40 and not scheduler.has_unfinished_requests()


def test_an_abort_with_a_client_ends_only_that_clients_request(build):
    scheduler, worker = build(10)
    request = make_request("a", list(range(8)), max_tokens=100)
    request.client_id = 1
    scheduler.add_request(request)
    _step(scheduler, worker)
    scheduler.abort_requests(["a"], client_id=2)  # another client's abort of the same id
    _step(scheduler, worker)
    assert not request.is_finished and scheduler.has_unfinished_requests()
    scheduler.abort_requests(["a"], client_id=1)
    assert request.status == RequestStatus.FINISHED_ABORTED
