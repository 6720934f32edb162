"""Property tests: random interleavings of add / schedule / finish / abort / preempt keep the
block-manager invariants, and every output equals the unbatched reference."""

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.common.config import CacheConfig, SchedulerConfig
from services.scheduler.scheduler import Scheduler
from tests.helpers.scheduler_invariants import check_invariants
from tests.scheduler.stand_in_worker import (
    StandInWorker,
    make_request,
    reference_generate,
    run_to_completion,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 16
NUM_CPU_BLOCKS = 24


request_st = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(0, 3),  # shared-prefix family
    st.integers(1, 12),  # max_tokens
    st.sampled_from([1, 1, 1, 2, 3]),  # n
)
op_st = st.one_of(
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.just(0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_st, min_size=1, max_size=40),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    chunked=st.booleans(),
    budget=st.sampled_from([8, 32, 64]),
)
@example(  # found by this test: swap preemption of a forked child holding no blocks yet
    ops=[
        ("add", (1, 0, 1, 2)),
        ("add", (1, 0, 1, 3)),
        ("add", (9, 0, 1, 3)),
        ("add", (16, 0, 2, 1)),
        ("add", (1, 0, 1, 2)),
    ],
    mode="swap",
    caching=False,
    chunked=False,
    budget=8,
)
def test_random_interleavings_keep_invariants(ops, mode, caching, chunked, budget):
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=budget if chunked else 64,
        max_model_len=64,
        enable_chunked_prefill=chunked,
        preemption_mode=mode,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching)
    scheduler = Scheduler(config, cache, NUM_BLOCKS, NUM_CPU_BLOCKS)
    worker = StandInWorker(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS)
    added, aborted = {}, set()
    for op, arg in ops:
        if op == "add":
            length, family, max_tokens, n = arg
            rid = f"r{len(added)}"
            prompt = [100 + family] * min(length, 8) + list(range(len(added), length))[: length - 8]
            seed = len(added) if n > 1 else None
            request = make_request(
                rid, prompt[:length], BLOCK_SIZE, max_tokens=max_tokens, n=n, seed=seed
            )
            scheduler.add_request(request)
            added[rid] = request
        elif op == "step":
            for _ in range(arg):
                plan = scheduler.schedule()
                scheduler.update_from_output(plan, worker.execute(plan))
                check_invariants(scheduler)
        elif op == "abort" and added:
            rid = sorted(added)[arg % len(added)]
            scheduler.abort_requests([rid])
            aborted.add(rid)
        elif op == "preempt" and scheduler.running:
            scheduler._preempt(scheduler.running[-1])
        check_invariants(scheduler)
    run_to_completion(scheduler, worker)
    check_invariants(scheduler)
    assert scheduler.kv.num_free_blocks == NUM_BLOCKS
    assert not scheduler.kv.req_to_blocks and not scheduler.requests
    for rid, request in added.items():
        if rid in aborted or request.sampling_params.n > 1:
            continue
        expected = reference_generate(request.prompt_token_ids, request.sampling_params, 64)
        assert request.output_token_ids == expected, rid
