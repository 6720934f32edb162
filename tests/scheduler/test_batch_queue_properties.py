"""Property test at batch-queue depth 2: random interleavings of add / step / abort /
preempt through the EngineCore, with plans really outstanding, keep the block-manager
invariants, never put a request in two plans in flight, and give the reference outputs."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.config import CacheConfig, SchedulerConfig
from services.scheduler.engine_core import EngineCore
from services.scheduler.scheduler import Scheduler
from tests.helpers.scheduler_invariants import check_in_flight, check_invariants
from tests.scheduler.stand_in_executor import StandInExecutor
from tests.scheduler.stand_in_worker import StandInWorker, make_request, reference_generate

BLOCK_SIZE = 4
NUM_BLOCKS = 16
NUM_CPU_BLOCKS = 24

request_st = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(0, 3),  # shared-prefix family
    st.integers(1, 12),  # max_tokens
    st.sampled_from([1, 1, 1, 2, 3]),  # n
    st.booleans(),  # beam search (for n > 1)
)
op_st = st.one_of(
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.just(0)),
)


def _request(rid: str, index: int, arg):
    length, family, max_tokens, n, beam = arg
    prompt = [100 + family] * min(length, 8) + list(range(index, length))[: length - 8]
    if n > 1 and beam:  # two beams that fit the pool together (a bigger group can thrash)
        return make_request(
            rid, prompt[:12], BLOCK_SIZE, n=2, use_beam_search=True, temperature=0, max_tokens=6
        )
    seed = index if n > 1 else None
    return make_request(rid, prompt, BLOCK_SIZE, max_tokens=max_tokens, n=n, seed=seed)


def _preempt_one(scheduler: Scheduler) -> None:
    """Preempt the newest running request that has no step in flight, if any."""
    idle = [r for r in scheduler.running if not r.in_flight]
    if idle:
        scheduler._preempt(idle[-1])


def _check(scheduler: Scheduler) -> None:
    check_invariants(scheduler)
    check_in_flight(scheduler)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_st, min_size=1, max_size=40),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    budget=st.sampled_from([8, 32, 64]),
    eager=st.booleans(),
)
def test_random_interleavings_at_depth_two(ops, mode, caching, budget, eager):
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=64, preemption_mode=mode
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching)
    scheduler = Scheduler(config, cache, NUM_BLOCKS, NUM_CPU_BLOCKS)
    worker = StandInWorker(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS)
    core = EngineCore(scheduler, StandInExecutor(worker, 2, eager=eager))
    added, aborted = {}, set()
    for op, arg in ops:
        if op == "add":
            rid = f"r{len(added)}"
            added[rid] = _request(rid, len(added), arg)
            core.scheduler.add_request(added[rid])
        elif op == "step":
            for _ in range(arg):
                core.step()
                _check(scheduler)
        elif op == "abort" and added:
            rid = sorted(added)[arg % len(added)]
            core.abort_requests([rid])
            aborted.add(rid)
        elif op == "preempt":
            _preempt_one(scheduler)
        _check(scheduler)
    for _ in range(10_000):
        if not core.has_work():
            break
        core.step()
        _check(scheduler)
    assert not core.has_work(), "the engine core hangs"
    assert scheduler.kv.num_free_blocks == NUM_BLOCKS
    assert not scheduler.kv.req_to_blocks and not scheduler.requests
    assert not scheduler.in_flight.groups and len(core.batch_queue) == 0
    for rid, request in added.items():
        if rid in aborted or request.sampling_params.n > 1:
            continue
        expected = reference_generate(request.prompt_token_ids, request.sampling_params, 64)
        assert request.output_token_ids == expected, rid
