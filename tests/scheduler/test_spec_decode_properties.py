"""Property test: random interleavings of add / step / abort / preempt with random
proposals (some right, some wrong, of random lengths) and the draft model's lookahead or
not keep the block-manager invariants, schedule every proposal within its caps, keep the
spec_decode_* stats consistent, and leave every output equal to the reference."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.config import CacheConfig, SchedulerConfig
from services.scheduler.scheduler import Scheduler
from tests.helpers.scheduler_invariants import check_invariants, check_spec_decode_stats
from tests.scheduler.stand_in_worker import (
    StandInWorker,
    make_request,
    random_proposer,
    reference_generate,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 20
NUM_CPU_BLOCKS = 24
MAX_MODEL_LEN = 48

request_st = st.tuples(
    st.integers(1, 24),  # prompt length
    st.integers(0, 2),  # shared-prefix family
    st.integers(1, 16),  # max_tokens
    st.sampled_from([1, 1, 1, 2, 3]),  # n
    st.booleans(),  # a stop token id from the request's own continuation
)
op_st = st.one_of(
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.just(0)),
)


def check_plan(scheduler: Scheduler, plan, k: int, budget: int) -> None:
    """Every scheduled request runs at least one token (the worker refuses fewer);
    proposals only for a sequence's last known token, all scheduled, at most k, within the
    budget, max_tokens and max_model_len."""
    assert plan.total_num_scheduled_tokens <= budget
    assert all(n >= 1 for n in plan.num_scheduled_tokens.values()), plan.num_scheduled_tokens
    for rid, drafts in plan.scheduled_spec_decode_tokens.items():
        assert 1 <= len(drafts) <= k
        assert plan.num_scheduled_tokens[rid] == len(drafts) + 1
        request = scheduler.requests[rid]
        assert request.num_tokens + len(drafts) + 1 <= scheduler.max_model_len
        max_tokens = request.sampling_params.max_tokens
        assert request.num_output_tokens + len(drafts) + 1 <= max_tokens


def _request(rid, index, length, family, max_tokens, n, with_stop):
    prompt = [100 + family] * min(length, 8) + list(range(index, length))[: length - 8]
    prompt = prompt[:length]
    seed = index if n > 1 else None
    stops = []
    if with_stop and seed is None:  # a token its reference produces: stops inside runs
        reference = reference_generate(prompt, make_request("x", prompt).sampling_params, 64)
        stops = [reference[min(3, len(reference) - 1)]]
    return make_request(
        rid, prompt, BLOCK_SIZE, max_tokens=max_tokens, n=n, seed=seed, stop_token_ids=stops
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_st, min_size=1, max_size=40),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    budget=st.sampled_from([6, 16, 64]),
    k=st.integers(1, 5),
    draft_model=st.booleans(),
    accuracy=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_random_proposals_keep_invariants_and_outputs(
    ops, mode, caching, budget, k, draft_model, accuracy, seed
):
    config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        preemption_mode=mode,
    )
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching)
    lookahead = k if draft_model else 0
    scheduler = Scheduler(config, cache, NUM_BLOCKS, NUM_CPU_BLOCKS, num_lookahead_tokens=lookahead)
    worker = StandInWorker(
        NUM_BLOCKS,
        BLOCK_SIZE,
        NUM_CPU_BLOCKS,
        proposer=random_proposer(k, random.Random(seed), accuracy),
        max_model_len=scheduler.max_model_len,
        lookahead=lookahead,
    )
    added, aborted, sequences = {}, set(), {}

    def one_step():
        sequences.update(scheduler.requests)
        plan = scheduler.schedule()
        check_plan(scheduler, plan, k, budget)
        scheduler.update_from_output(plan, worker.execute(plan))
        sequences.update(scheduler.requests)
        check_invariants(scheduler)
        check_spec_decode_stats(scheduler)

    for op, arg in ops:
        if op == "add":
            rid = f"r{len(added)}"
            added[rid] = _request(rid, len(added), *arg)
            scheduler.add_request(added[rid])
        elif op == "step":
            for _ in range(arg):
                one_step()
        elif op == "abort" and added:
            rid = sorted(added)[arg % len(added)]
            scheduler.abort_requests([rid])
            aborted.add(rid)
        elif op == "preempt" and scheduler.running:
            scheduler._preempt(scheduler.running[-1])
        check_invariants(scheduler)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and not scheduler.has_pending_outputs():
            break
        one_step()
    assert not scheduler.has_unfinished_requests(), "the scheduler hangs"
    check_invariants(scheduler)
    assert scheduler.kv.num_free_blocks == NUM_BLOCKS
    assert len(scheduler.kv.cpu_free) == NUM_CPU_BLOCKS
    assert not scheduler.kv.req_to_blocks and not scheduler.requests
    for sequence in sequences.values():
        group = sequence.request_id.split("#")[0]
        if group in aborted:
            continue
        expected = reference_generate(
            sequence.prompt_token_ids, sequence.sampling_params, scheduler.max_model_len
        )
        assert sequence.output_token_ids == expected, sequence.request_id
