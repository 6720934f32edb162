"""Plans in flight: the batch queue, and outputs that never depend on its depth.

Depth 2 with one stand-in worker is async scheduling: the next plan is made while the
previous one is outstanding, so running requests alternate between two half batches.
Every output must still equal depth 1's, with the block manager consistent throughout.
"""

from concurrent.futures import Future

import pytest

from services.common.config import CacheConfig, SchedulerConfig
from services.scheduler.batch_queue import BatchQueue
from services.scheduler.engine_core import EngineCore, carries_nothing
from services.scheduler.executor.uni import UniExecutor
from services.scheduler.scheduler import Scheduler
from tests.helpers.scheduler_invariants import check_in_flight, check_invariants
from tests.scheduler.stand_in_executor import StandInExecutor
from tests.scheduler.stand_in_worker import StandInWorker, make_request, reference_generate

BLOCK_SIZE = 4
NUM_CPU_BLOCKS = 64
SHARED = list(range(100, 113))  # three full blocks and a bit


def test_batch_queue_keeps_order_and_bound():
    queue = BatchQueue(2)
    plans = [make_plan_stub(i) for i in range(3)]
    queue.push(plans[0], Future())
    assert queue.has_room and len(queue) == 1
    queue.push(plans[1], Future())
    assert not queue.has_room
    with pytest.raises(RuntimeError, match="full"):
        queue.push(plans[2], Future())
    assert queue.pop_oldest().plan is plans[0]
    assert queue.pop_oldest().plan is plans[1]
    with pytest.raises(IndexError):
        queue.pop_oldest()
    with pytest.raises(ValueError, match="at least 1"):
        BatchQueue(0)


def make_plan_stub(index: int):
    from services.common.scheduler_output import SchedulerOutput

    return SchedulerOutput(finished_req_ids={f"stub{index}"})


def _beam(rid, prompt, width, max_tokens):
    return make_request(
        rid, prompt, BLOCK_SIZE, n=width, use_beam_search=True, temperature=0, max_tokens=max_tokens
    )


def _waves():
    """Plain, chunked, prefix-sharing, n > 1 and beam-search requests, in two waves."""
    first = [
        make_request("plain", [5, 6, 7], BLOCK_SIZE, max_tokens=10),
        make_request("long", list(range(200, 231)), BLOCK_SIZE, max_tokens=6),
        make_request("pre0", [*SHARED, 1, 2], BLOCK_SIZE, max_tokens=8),
        make_request("pre1", [*SHARED, 3], BLOCK_SIZE, max_tokens=8),
        make_request("par", list(range(300, 310)), BLOCK_SIZE, n=3, seed=5, max_tokens=7),
        _beam("beam", list(range(400, 406)), 2, 5),
    ]
    second = [
        make_request("pre2", [*SHARED, 9, 9, 9], BLOCK_SIZE, max_tokens=9),
        make_request("late", [42] * 19, BLOCK_SIZE, max_tokens=12, ignore_eos=True),
        _beam("beam3", [7, 8, 9, 10, 11], 3, 4),
        make_request("par2", [*SHARED, 4], BLOCK_SIZE, n=2, seed=9, max_tokens=5),
    ]
    return [first, second]


def _collect(outputs: dict, batches) -> None:
    for batch in batches.values():
        for out in batch.outputs:
            tokens, _ = outputs.get((out.request_id, out.index), ([], None))
            outputs[(out.request_id, out.index)] = (tokens + out.new_token_ids, out.finish_reason)


def _scheduler(num_blocks, budget, mode, caching):
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=2048, preemption_mode=mode
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching)
    return Scheduler(config, cache, num_blocks, NUM_CPU_BLOCKS)


def run_waves(executor_factory, num_blocks, budget, mode, caching):
    """Run both waves through an EngineCore; (outputs by (id, index), scheduler, executor)."""
    scheduler = _scheduler(num_blocks, budget, mode, caching)
    worker = StandInWorker(num_blocks, BLOCK_SIZE, NUM_CPU_BLOCKS)
    executor = executor_factory(worker)
    core = EngineCore(scheduler, executor)
    outputs: dict = {}
    for wave in _waves():
        for request in wave:
            core.scheduler.add_request(request)
        for _ in range(5):
            _collect(outputs, core.step())
            check_invariants(scheduler)
            check_in_flight(scheduler)
    for _ in range(5000):
        if not core.has_work():
            break
        _collect(outputs, core.step())
        check_invariants(scheduler)
        check_in_flight(scheduler)
    assert not core.has_work(), "the engine core hangs"
    executor.close()
    return outputs, scheduler, executor


def check_all_freed(scheduler: Scheduler, num_blocks: int) -> None:
    assert scheduler.kv.num_free_blocks == num_blocks
    assert len(scheduler.kv.cpu_free) == NUM_CPU_BLOCKS
    assert not scheduler.requests and not scheduler.kv.req_to_blocks
    assert not scheduler.in_flight.groups and not scheduler.groups.beam_groups


POOLS = [(64, 512), (24, 16), (14, 8)]  # (blocks, token budget): roomy to preempting


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize(("num_blocks", "budget"), POOLS)
def test_depth_two_outputs_equal_depth_one(mode, caching, num_blocks, budget):
    sync, sync_scheduler, _ = run_waves(
        lambda w: StandInExecutor(w, 1), num_blocks, budget, mode, caching
    )
    deep, deep_scheduler, executor = run_waves(
        lambda w: StandInExecutor(w, 2), num_blocks, budget, mode, caching
    )
    assert deep == sync
    if budget < 512:  # a budget that splits the batch: plans really were in flight together
        assert executor.max_outstanding == 2
    for scheduler in (sync_scheduler, deep_scheduler):
        check_all_freed(scheduler, num_blocks)
    if num_blocks == 14:
        assert sync_scheduler.num_preemptions > 0 and deep_scheduler.num_preemptions > 0
    for wave in _waves():
        for request in wave:
            if request.sampling_params.n == 1:
                expected = reference_generate(request.prompt_token_ids, request.sampling_params, 56)
                assert deep[(request.request_id, 0)][0] == expected
    assert {key[0] for key in deep} >= {"par", "par#1", "par#2", "beam", "beam3"}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_threaded_depth_two_equals_depth_one(mode):
    """The real UniExecutor: the worker thread runs one plan while the next is made."""
    sync, _, _ = run_waves(lambda w: UniExecutor(w, 1), 14, 8, mode, True)
    deep, scheduler, _ = run_waves(lambda w: UniExecutor(w, 2), 14, 8, mode, True)
    assert deep == sync
    check_all_freed(scheduler, 14)


def test_a_request_waits_rather_than_preempting_past_steps_in_flight(build):
    """Out of blocks while only a newer, in-flight request could give some up: wait a step,
    then preempt that request once its step has landed (what depth 1 would have done)."""
    scheduler, worker = build(8, block_size=4)
    old = make_request("old", [1, 2, 3, 4], 4, max_tokens=20, ignore_eos=True)
    new = make_request("new", [5, 6, 7], 4, max_tokens=20, ignore_eos=True)
    scheduler.add_request(old)
    first = scheduler.schedule()
    scheduler.add_request(new)
    second = scheduler.schedule()
    assert first.num_scheduled_tokens == {"old": 4}
    assert second.num_scheduled_tokens == {"new": 3}  # old is in flight: not scheduled again
    scheduler.update_from_output(first, worker.execute(first))
    hog = scheduler.kv.pool.get_new_blocks(scheduler.kv.num_free_blocks)
    third = scheduler.schedule()  # old needs a block; only the in-flight "new" is newer
    assert carries_nothing(third) and scheduler.num_preemptions == 0
    assert old in scheduler.running and new.in_flight
    scheduler.update_from_output(second, worker.execute(second))
    fourth = scheduler.schedule()
    assert fourth.num_scheduled_tokens == {"old": 1}
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [new]
    scheduler.update_from_output(fourth, worker.execute(fourth))
    scheduler.kv.pool.free_blocks(hog)


def test_group_is_not_scheduled_while_a_member_is_in_flight(build):
    scheduler, worker = build(40, max_num_batched_tokens=10)
    scheduler.add_request(make_request("g", list(range(20)), n=3, seed=1, max_tokens=4))
    first = scheduler.schedule()  # a chunk of the group's one prefill
    assert scheduler.is_blocked(scheduler.requests["g"])
    assert carries_nothing(scheduler.schedule())  # neither the rest nor the fork may run
    scheduler.update_from_output(first, worker.execute(first))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"g": 9}  # prompt - 1: the group's prefill
    scheduler.update_from_output(second, worker.execute(second))
    third = scheduler.schedule()  # forked now that nothing is in flight
    assert set(third.num_scheduled_tokens) == {"g", "g#1", "g#2"}


def test_abort_of_an_in_flight_request_frees_now_and_ignores_its_step(build):
    scheduler, worker = build(10)
    scheduler.add_request(make_request("a", list(range(30)), max_tokens=5))
    plan = scheduler.schedule()
    scheduler.abort_requests(["a"])
    assert scheduler.kv.num_free_blocks == 10 and not scheduler.in_flight.groups
    scheduler.add_request(make_request("a", [7, 8, 9], max_tokens=2))  # the id, reused
    reused = scheduler.schedule()
    assert reused.finished_req_ids == {"a"}  # the worker drops the old "a" first
    outputs = scheduler.update_from_output(plan, worker.execute(plan))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs[0].outputs] == [([], "abort")]
    assert scheduler.requests["a"].output_token_ids == []  # not the old step's token
    scheduler.update_from_output(reused, worker.execute(reused))
    assert scheduler.requests["a"].num_output_tokens == 1
