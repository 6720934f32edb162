"""Speculative decoding in the scheduler, over the spec stand-in worker: proposals are
scheduled after a decoding sequence's token within its caps (budget, max_tokens,
max_model_len), num_computed_tokens rolls back over the rejected ones and trim frees the
blocks only they touched, rejected tokens never reach the prefix cache, a stop inside an
accepted run truncates it, the draft model's lookahead slots are never shared between
forked sequences, and the spec_decode_* stats add up. Outputs always equal the reference
loop whatever was proposed."""

from __future__ import annotations

import pytest

from services.common.config import CacheConfig, SchedulerConfig
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.spec_decode_stats import SpecDecodeStats
from tests.helpers.scheduler_invariants import check_invariants, check_spec_decode_stats
from tests.scheduler.stand_in_worker import (
    StandInWorker,
    accurate,
    make_request,
    reference_generate,
    true_continuation,
    wrong,
    wrong_token,
)

BS = 4


def build(num_blocks=32, proposer=None, lookahead=0, num_cpu_blocks=0, caching=True, **config):
    config.setdefault("max_model_len", 256)
    scheduler = Scheduler(
        SchedulerConfig(**config),
        CacheConfig(block_size=BS, enable_prefix_caching=caching),
        num_device_blocks=num_blocks,
        num_cpu_blocks=num_cpu_blocks,
        num_lookahead_tokens=lookahead,
    )
    worker = StandInWorker(
        num_blocks,
        BS,
        num_cpu_blocks,
        proposer=proposer,
        max_model_len=scheduler.max_model_len,
        lookahead=lookahead,
    )
    return scheduler, worker


def step(scheduler, worker):
    plan = scheduler.schedule()
    outputs = scheduler.update_from_output(plan, worker.execute(plan))
    check_invariants(scheduler)
    check_spec_decode_stats(scheduler)
    return plan, [o for batch in outputs.values() for o in batch.outputs]


def run(scheduler, worker, max_steps=2000):
    """Every request to its end; the new token ids per sequence id, and the plans."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not scheduler.has_pending_outputs():
            assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
            assert not scheduler.kv.req_to_blocks
            return outputs
        _, outs = step(scheduler, worker)
        for out in outs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("requests did not finish")


def expected(request) -> list[int]:
    return reference_generate(request.prompt_token_ids, request.sampling_params, 256)


# ---- roll-back and trim ------------------------------------------------------------------
def test_rejected_proposals_roll_back_and_their_blocks_are_freed():
    scheduler, worker = build(16, proposer=wrong(4))
    request = make_request("a", list(range(10, 16)), BS, max_tokens=8)
    scheduler.add_request(request)
    step(scheduler, worker)  # prefill 6, samples 1: 7 known, 4 wrong proposals
    drafts = [wrong_token(request.all_token_ids, None)] * 4
    assert request.spec_token_ids == drafts
    assert scheduler.kv.num_free_blocks == 14
    plan = scheduler.schedule()
    assert plan.scheduled_spec_decode_tokens == {"a": drafts} and not request.spec_token_ids
    assert plan.num_scheduled_tokens == {"a": 5}  # its token and the 4 proposals
    assert request.num_computed_tokens == 11
    assert len(scheduler.kv.block_table("a")[0]) == 3  # positions 6..10 reach a third block
    scheduler.update_from_output(plan, worker.execute(plan))
    check_invariants(scheduler)
    # all 4 rejected: computed = 7 (the 6 prompt + the first token), the third block freed
    assert request.num_computed_tokens == 7 and request.num_tokens == 8
    assert len(scheduler.kv.block_table("a")[0]) == 2 and scheduler.kv.num_free_blocks == 14
    stats = scheduler.get_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (1, 4)
    assert stats.spec_decode_num_accepted_tokens == 0
    # the worker gets the trimmed table whole, computed tokens rolled back
    plan, _ = step(scheduler, worker)
    cached = plan.scheduled_cached_reqs
    assert cached.resumed_from_preemption == [True]
    assert cached.num_computed_tokens == [7]
    assert cached.new_block_ids[0][0][:2] == scheduler.kv.block_table("a")[0][:2]
    run(scheduler, worker)
    assert request.output_token_ids == expected(request)


@pytest.mark.parametrize("num_right", [0, 1, 2, 3, 4])
def test_accepted_prefix_then_the_targets_token(num_right):
    """Proposals right up to num_right, then wrong: num_right accepted, num_right + 1 new
    tokens, computed tokens rolled back to all but the newest, blocks trimmed to them."""

    def propose(rid, tokens, seed, room):
        right = true_continuation(tokens, seed, 4)
        return right[:num_right] + [(t + 7) % 1000 for t in right[num_right:]]

    scheduler, worker = build(16, proposer=propose)
    request = make_request("a", list(range(20, 27)), BS, max_tokens=40, ignore_eos=True)
    scheduler.add_request(request)
    step(scheduler, worker)
    before = request.num_output_tokens
    plan, outs = step(scheduler, worker)
    assert plan.num_scheduled_tokens == {"a": 5}
    assert len(outs[0].new_token_ids) == num_right + 1
    assert request.num_output_tokens == before + num_right + 1
    assert request.num_computed_tokens == request.num_tokens - 1
    assert len(scheduler.kv.block_table("a")[0]) == -(-request.num_computed_tokens // BS)
    stats = scheduler.get_stats()
    assert stats.spec_decode_num_accepted_tokens == num_right
    assert stats.spec_decode_num_accepted_tokens_per_pos == (1,) * num_right + (0,) * (
        4 - num_right
    )
    run(scheduler, worker)
    assert request.output_token_ids == expected(request)


def test_all_accepted_runs_emit_k_plus_one_tokens_per_step():
    scheduler, worker = build(32, proposer=accurate(3))
    request = make_request("a", [5, 6, 7], BS, max_tokens=21, ignore_eos=True)
    scheduler.add_request(request)
    sizes = []
    while scheduler.has_unfinished_requests():
        _, outs = step(scheduler, worker)
        sizes += [len(o.new_token_ids) for o in outs]
    assert sizes == [1, 4, 4, 4, 4, 4]  # 21 = 1 + 5 * 4: every proposal accepted
    stats = scheduler.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens == 15
    assert stats.spec_decode_num_accepted_tokens_per_pos == (5, 5, 5)
    assert request.output_token_ids == expected(request)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_rejected_step_frees_blocks_that_other_requests_then_use():
    """A tight cache (10 blocks, 3 requests growing to 4-5 blocks, 6 wrong proposals a
    step): what trim frees goes back to the pool and is handed out again; the worker's
    read-back of every context proves no live block was handed out twice."""
    scheduler, worker = build(10, proposer=wrong(6))
    trimmed = []
    trim = scheduler.kv.trim
    scheduler.kv.trim = lambda request: trimmed.append(trim(request)) or trimmed[-1]
    requests = [
        make_request(r, [i + 3] * (5 + i), BS, max_tokens=12, ignore_eos=True)
        for i, r in enumerate("abc")
    ]
    for request in requests:
        scheduler.add_request(request)
    outputs = run(scheduler, worker)
    for request in requests:
        assert outputs[request.request_id] == expected(request)
    assert sum(trimmed) > 0 and scheduler.num_preemptions > 0
    stats = scheduler.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens == 0


# ---- the prefix cache ------------------------------------------------------------------
def test_rejected_proposals_are_never_hashed_into_the_prefix_cache():
    scheduler, worker = build(32, proposer=wrong(4))
    a = make_request("a", list(range(30, 36)), BS, max_tokens=6, ignore_eos=True)  # 6 prompt
    scheduler.add_request(a)
    step(scheduler, worker)  # 7 known: positions 0..6
    drafts = list(a.spec_token_ids)
    plan, _ = step(scheduler, worker)  # verifies 4 proposals at positions 7..10: rejected
    assert plan.scheduled_spec_decode_tokens == {"a": drafts}
    real_hashes = set(a.block_hashes)
    cached = scheduler.kv.pool.cached_block_hash_to_block
    assert set(cached) <= real_hashes
    # A prompt that is what the cache would hold had the rejected proposals been kept:
    # only its first block (real tokens) is a hit.
    sham = a.all_token_ids[:7] + drafts[:1] + drafts[1:4] + [1, 2, 3, 4, 5]
    run(scheduler, worker)
    b = make_request("b", sham, BS, max_tokens=2)
    _, num_hit = scheduler.kv.get_computed_blocks(b)
    assert num_hit == 4
    # ... while the real tokens of the finished request are hits, a block further
    real = [*a.all_token_ids[:9], 1, 2, 3]
    c = make_request("c", real, BS, max_tokens=2)
    assert scheduler.kv.get_computed_blocks(c)[1] == 8
    for block in scheduler.kv.pool.cached_block_hash_to_block.values():
        assert block.block_hash in set(a.block_hashes)


def test_prefix_hits_and_proposals_together_keep_outputs():
    scheduler, worker = build(40, proposer=accurate(3))
    prefix = list(range(50, 63))
    requests = [
        make_request(f"r{i}", prefix + [70 + i] * i, BS, max_tokens=9, ignore_eos=True)
        for i in range(4)
    ]
    for request in requests:
        scheduler.add_request(request)
        step(scheduler, worker)  # one at a time: the later ones hit the earlier's blocks
    run(scheduler, worker)
    assert scheduler.kv.prefix_cache_hits > 0
    for request in requests:
        assert request.output_token_ids == expected(request)


# ---- caps --------------------------------------------------------------------------------
def test_proposals_stop_at_max_tokens():
    scheduler, worker = build(32, proposer=accurate(10))
    request = make_request("a", [9, 8, 7], BS, max_tokens=5, ignore_eos=True)
    scheduler.add_request(request)
    step(scheduler, worker)  # 1 output token, 10 proposals
    plan, outs = step(scheduler, worker)
    assert len(plan.scheduled_spec_decode_tokens["a"]) == 3  # 1 + 3 + 1 = max_tokens 5
    assert len(outs[0].new_token_ids) == 4 and outs[0].finish_reason == "length"
    assert request.output_token_ids == expected(request)
    assert scheduler.kv.num_free_blocks == 32


def test_proposals_stop_at_max_model_len():
    scheduler, worker = build(32, proposer=accurate(10), max_model_len=12)
    request = make_request("a", list(range(40, 48)), BS, max_tokens=50, ignore_eos=True)
    scheduler.add_request(request)
    step(scheduler, worker)  # 9 known
    plan, outs = step(scheduler, worker)
    assert len(plan.scheduled_spec_decode_tokens["a"]) == 2  # 9 + 2 + 1 = max_model_len 12
    assert len(outs[0].new_token_ids) == 3 and outs[0].finish_reason == "length"
    assert request.num_tokens == 12 and request.output_token_ids == expected(request)[:4]


def test_proposals_stay_within_the_token_budget():
    scheduler, worker = build(64, proposer=accurate(6), max_num_batched_tokens=5)
    a = make_request("a", [1, 2, 3], BS, max_tokens=30, ignore_eos=True)
    b = make_request("b", [4, 5], BS, max_tokens=30, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plans = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, worker)
        plans.append(plan)
        assert plan.total_num_scheduled_tokens <= 5
        for rid, drafts in plan.scheduled_spec_decode_tokens.items():
            assert plan.num_scheduled_tokens[rid] == len(drafts) + 1
    assert any(len(d) == 4 for p in plans for d in p.scheduled_spec_decode_tokens.values())
    assert a.output_token_ids == expected(a) and b.output_token_ids == expected(b)


def test_proposals_kept_over_a_recompute_are_verified_only_after_the_prefill():
    """A request preempted (recompute) with proposals still on it prefills again in chunks
    of 8 (17 known tokens: 8, 8, then 1): no chunk verifies them but (maybe) the last,
    whose one token is the last known one; the output is unchanged."""
    scheduler, worker = build(
        64,
        proposer=accurate(3),
        caching=False,
        max_num_batched_tokens=8,
        long_prefill_token_threshold=8,
    )
    request = make_request("a", list(range(100, 116)), BS, max_tokens=12, ignore_eos=True)
    scheduler.add_request(request)
    step(scheduler, worker)
    step(scheduler, worker)
    assert request.num_tokens == 17 and request.spec_token_ids
    drafts = list(request.spec_token_ids)
    scheduler._preempt(request)
    plans = [step(scheduler, worker)[0] for _ in range(3)]
    assert [p.num_scheduled_tokens["a"] for p in plans][:2] == [8, 8]
    assert [p.scheduled_spec_decode_tokens for p in plans[:2]] == [{}, {}]
    # the last chunk is the last known token: it may verify them (they still follow it)
    assert plans[2].scheduled_spec_decode_tokens in ({}, {"a": drafts})
    assert plans[2].num_scheduled_tokens["a"] == 1 + len(
        plans[2].scheduled_spec_decode_tokens.get("a", [])
    )
    run(scheduler, worker)
    assert request.output_token_ids == expected(request)


# ---- stops inside an accepted run --------------------------------------------------------
def test_a_stop_token_inside_an_accepted_run_ends_it_there():
    prompt = [11, 12, 13, 14, 15]
    first = true_continuation(prompt, None, 6)
    stop = first[3]  # the third proposal of the first verification
    assert stop not in first[:3]
    scheduler, worker = build(32, proposer=accurate(4))
    request = make_request(
        "a", prompt, BS, max_tokens=40, stop_token_ids=[stop], logprobs=1, ignore_eos=True
    )
    scheduler.add_request(request)
    _, outs = step(scheduler, worker)
    assert outs[0].new_token_ids == first[:1]
    _, outs = step(scheduler, worker)  # verifies first[1:5]: all accepted, + first[5]
    assert outs[0].new_token_ids == first[1:4]  # cut after the stop token
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == stop
    assert len(outs[0].new_logprobs) == 3  # logprobs cut with the tokens
    assert request.output_token_ids == expected(request) == first[:4]
    assert scheduler.kv.num_free_blocks == 32
    assert scheduler.get_stats().spec_decode_num_accepted_tokens == 4  # as the worker said


def test_min_tokens_and_stop_ids_inside_runs_match_the_reference():
    scheduler, worker = build(64, proposer=accurate(5))
    prompts = [[i + 1] * (3 + i) for i in range(6)]
    requests = []
    for i, prompt in enumerate(prompts):
        run_tokens = true_continuation(prompt, None, 12)
        params = dict(max_tokens=4 + 3 * i, ignore_eos=True, stop_token_ids=[run_tokens[2 + i]])
        if i % 2:
            params["min_tokens"] = 6
        requests.append(make_request(f"r{i}", prompt, BS, **params))
        scheduler.add_request(requests[-1])
    run(scheduler, worker)
    for request in requests:
        assert request.output_token_ids == expected(request), request.request_id
    assert scheduler.get_stats().spec_decode_num_accepted_tokens > 0


# ---- forks and the draft model's lookahead slots -----------------------------------------
def test_forked_sequences_do_not_share_lookahead_blocks():
    """n = 2 with a draft model's 3 lookahead slots: the parent's prefill of 7 of its 8
    prompt tokens holds blocks up to position 9. The sequences must not share the block
    of positions 8..11 where each writes its own next token."""
    scheduler, _ = build(32, lookahead=3)
    scheduler.add_request(make_request("g", list(range(10, 18)), BS, n=2, seed=1, max_tokens=6))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"g": 7}
    scheduler.update_from_output(plan, StandInWorker(32, BS).execute(plan))
    scheduler.schedule()  # the fork; each sequence computes prompt position 7
    tables = {r: scheduler.kv.block_table(r)[0] for r in ("g", "g#1")}
    writes_at = 8 // BS  # the block of the next position each writes (its first output)
    mine = [t[writes_at] for t in tables.values() if len(t) > writes_at]
    assert len(set(mine)) == len(mine), tables
    check_invariants(scheduler)


def _forked_kv_manager():
    kv = KVCacheManager(BS, 16)
    parent = make_request("p", list(range(8)), BS)
    parent.num_computed_tokens = 0
    assert kv.allocate_slots(parent, 7, num_lookahead_tokens=3) is not None  # slots 0..9
    parent.num_computed_tokens = 7
    return kv, parent


def test_fork_shares_only_the_blocks_of_computed_tokens():
    kv, parent = _forked_kv_manager()
    child = make_request("c", list(range(8)), BS)
    child.num_computed_tokens = 7
    kv.fork(parent, child)
    assert kv.block_table("c")[0] == kv.block_table("p")[0][:2]  # positions 0..6
    assert kv.pool.blocks[kv.block_table("p")[0][2]].ref_cnt == 1  # the lookahead stays its own
    kv.free(child)
    kv.free(parent)
    assert kv.num_free_blocks == 16


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_sampling_with_a_draft_models_lookahead(mode):
    scheduler, worker = build(
        40, proposer=accurate(3), lookahead=3, num_cpu_blocks=48, preemption_mode=mode
    )
    for i in range(3):
        prompt = list(range(10 + i, 18 + 3 * i))
        scheduler.add_request(make_request(f"g{i}", prompt, BS, n=3, seed=i, max_tokens=10))
    sequences = {}
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
        sequences.update(scheduler.requests)
    assert len(sequences) == 9
    for sequence in sequences.values():
        assert sequence.output_token_ids == expected(sequence), sequence.request_id
    assert scheduler.kv.num_free_blocks == 40
    assert scheduler.get_stats().spec_decode_num_accepted_tokens > 0


def test_beam_search_with_a_draft_models_lookahead_equals_without():
    def beams(lookahead):
        scheduler, worker = build(64, proposer=accurate(3), lookahead=lookahead)
        request = make_request(
            "b", list(range(60, 69)), BS, n=3, use_beam_search=True, max_tokens=8
        )
        scheduler.add_request(request)
        outputs = []
        while scheduler.has_unfinished_requests() or scheduler.has_pending_outputs():
            _, outs = step(scheduler, worker)
            outputs += [(o.index, o.new_token_ids, o.cumulative_logprob) for o in outs]
        assert scheduler.kv.num_free_blocks == 64
        return sorted(outputs)

    without = beams(0)
    assert len(without) == 3
    assert beams(3) == without


def test_preemption_with_rejections_keeps_outputs_in_both_modes():
    for mode in ("recompute", "swap"):
        for proposer in (wrong(3), accurate(3)):
            scheduler, worker = build(
                12, proposer=proposer, num_cpu_blocks=32, preemption_mode=mode, lookahead=3
            )
            requests = [
                make_request(f"r{i}", [i + 1] * (5 + i), BS, max_tokens=20, ignore_eos=True)
                for i in range(4)
            ]
            for request in requests:
                scheduler.add_request(request)
            outputs = run(scheduler, worker)
            assert scheduler.num_preemptions > 0, mode
            for request in requests:
                assert outputs[request.request_id] == expected(request), (mode, request)
            if mode == "swap":
                assert any(p.blocks_to_swap_in for p in worker.plans)


# ---- the counters ------------------------------------------------------------------------
def test_spec_decode_stats_count_by_position():
    stats = SpecDecodeStats()
    for drafted, accepted in [(3, 3), (3, 1), (5, 0), (2, 2), (1, 1)]:
        stats.observe(drafted, accepted)
    assert stats.num_drafts == 5
    assert stats.num_draft_tokens == 14 and stats.num_accepted_tokens == 7
    assert stats.accepted_per_pos == [4, 2, 1, 0, 0]
    with pytest.raises(AssertionError):
        stats.observe(2, 3)


def test_the_workers_bad_tokens_abort_only_that_request():
    """Tokens that are not an accepted prefix of the proposals plus one: that request is
    aborted, the others go on, and every block comes back."""
    scheduler, worker = build(32, proposer=accurate(3))
    a = make_request("a", [1, 2, 3], BS, max_tokens=10, ignore_eos=True)
    b = make_request("b", [4, 5, 6], BS, max_tokens=10, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, worker)
    plan = scheduler.schedule()
    proposed = plan.scheduled_spec_decode_tokens["a"]
    result = worker.execute(plan)
    row = result.request_ids.index("a")
    assert result.sampled_token_ids[row] == proposed + result.sampled_token_ids[row][-1:]
    result.sampled_token_ids[row] = [(proposed[0] + 1) % 1000, *proposed[1:]]
    scheduler.update_from_output(plan, result)
    check_invariants(scheduler)
    assert a.status == RequestStatus.FINISHED_ABORTED
    run(scheduler, worker)
    assert b.output_token_ids == expected(b)
