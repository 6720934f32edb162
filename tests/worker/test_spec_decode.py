"""Speculative decoding on the worker: the n-gram proposer, the verification rule
(accept_proposals), the InputBatch rows of a sequence that verifies proposals, and the
output distribution of the real Sampler over those rows (a chi-square test over many
seeded draws: the first emitted token follows the target's softmax at the first verified
position, the second, given an accepted proposal, the softmax at the next)."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np
import pytest
import torch

from services.common.convert.step import plan_from_pb, plan_to_pb
from services.worker.input_batch import InputBatch, InvalidPlanError
from services.worker.sampler import Sampler
from services.worker.spec_decode.ngram_proposer import propose_ngram
from services.worker.spec_decode.rejection_sampler import accept_proposals
from tests.helpers.scheduler_plans import new_req, plan


def ngram(tokens, min_n=1, max_n=5, k=4):
    return propose_ngram(np.array(tokens, np.int32), min_n, max_n, k)


# ---- the n-gram proposer -----------------------------------------------------------------
def test_the_longest_suffix_match_wins_over_a_later_shorter_one():
    tokens = [4, 2, 3, 10, 11, 9, 3, 12, 13, 4, 2, 3]  # "4 2 3" at 0, "3" alone at 6
    assert ngram(tokens, max_n=3, k=3) == [10, 11, 9]
    assert ngram(tokens, max_n=1, k=3) == [12, 13, 4]  # n = 1: the latest "3"


def test_among_equally_long_matches_the_latest_wins():
    tokens = [5, 1, 2, 6, 1, 2, 7, 1, 2]
    assert ngram(tokens, min_n=2, max_n=2, k=2) == [7, 1]
    assert ngram(tokens, min_n=2, max_n=4, k=5) == [7, 1, 2]  # runs to the end: 3 tokens


def test_max_n_bounds_the_match_length_compared():
    tokens = [4, 2, 3, 10, 8, 2, 3, 11, 4, 2, 3]  # "4 2 3" at 0; "2 3" at 5 too
    assert ngram(tokens, max_n=3, k=3) == [10, 8, 2]
    assert ngram(tokens, max_n=2, k=3) == [11, 4, 2]  # both match 2: the latest


def test_a_match_shorter_than_min_n_proposes_nothing():
    tokens = [1, 2, 3, 9, 3]  # "3" matches, "9 3" does not
    assert ngram(tokens, min_n=1, k=2) == [9, 3]
    assert ngram(tokens, min_n=2) == []
    assert ngram([1, 2], min_n=2) == []  # too short for any 2-gram with an earlier match


def test_no_match_k_cap_and_trivial_inputs():
    assert ngram([1, 2, 3, 4, 5]) == []
    assert ngram([7]) == []
    assert ngram([]) == []
    tokens = [1, 2, 3, 4, 5, 6, 7, 1]
    assert ngram(tokens, k=0) == []
    assert ngram(tokens, k=2) == [2, 3]
    assert ngram(tokens, k=100) == [2, 3, 4, 5, 6, 7, 1]  # all that follows the match


def test_a_match_right_before_the_end():
    assert ngram([7, 8, 9, 7, 8], k=5) == [9, 7, 8]
    # a run of one token: the latest longest match is the one just before the last token
    assert ngram([5, 5, 5, 5], max_n=3, k=4) == [5]
    assert ngram([5, 5], k=4) == [5]


def test_ngram_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        assert ngram(tokens, min_n, max_n, k) == _brute_force(tokens, min_n, max_n, k), (
            tokens,
            min_n,
            max_n,
            k,
        )


def _brute_force(tokens, min_n, max_n, k):
    """The docstring's rule: for n from max_n down to min_n, the latest earlier occurrence
    of the last n tokens; the k tokens after it."""
    num = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > num - 1:
            continue
        suffix = tokens[num - n :]
        for end in range(num - 2, n - 2, -1):  # the match ends at `end` < num - 1
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


# ---- the verification rule ---------------------------------------------------------------
def test_accept_proposals_keeps_the_accepted_prefix_then_the_targets_token():
    targets = [
        5,  # a: no proposals, its one token
        1, 2, 9, 4,  # b: proposals [1, 2, 3]: 1, 2 accepted, 9 instead of 3
        7, 8, 6,  # c: proposals [7, 8]: both accepted, 6 is the bonus token
        0, 1,  # d: proposal [3]: rejected at once, 0
    ]  # fmt: skip
    drafts = {"b": [1, 2, 3], "c": [7, 8], "d": [3]}
    kept, first_rows = accept_proposals(targets, ["a", "b", "c", "d"], drafts)
    assert kept == [[5], [1, 2, 9], [7, 8, 6], [0]]
    assert first_rows == [0, 1, 5, 8]
    with pytest.raises(AssertionError):
        accept_proposals(targets[:-1], ["a", "b", "c", "d"], drafts)  # rows do not add up


# ---- the InputBatch rows of a verifying sequence -----------------------------------------
def _batch_with_drafts(drafts, grammar_rows=0):
    batch = InputBatch(4, 4, 16, 100, 2, "cpu")
    first = plan(
        {"a": 3, "b": 2},
        new=[
            new_req("a", [10, 11, 12], [0], temperature=0.0),
            new_req("b", [20, 21], [1, 2], seed=3),
        ],
    )
    batch.update(first)
    batch.prepare(first)
    batch.append_sampled(["a", "b"], [[13], [22]])
    second = plan({"a": 1, "b": 1 + len(drafts)}, cached=[("a", [], 3, False), ("b", [], 2, False)])
    second = replace(second, scheduled_spec_decode_tokens={"b": list(drafts)} if drafts else {})
    if grammar_rows:
        words = np.full((grammar_rows, 4), -1, "<i4")
        for row in range(grammar_rows):
            words[row, 0] = ~(1 << row)  # row i bans token i
        second = replace(
            second, grammar_request_ids=["b"] * grammar_rows, grammar_bitmask=words.tobytes()
        )
    return batch, second


def test_a_verifying_sequence_feeds_its_proposals_and_samples_at_each_position():
    batch, second = _batch_with_drafts([23, 24, 25])
    batch.update(second)
    inputs = batch.prepare(second)
    assert inputs.input_ids.tolist() == [13, 22, 23, 24, 25]
    assert inputs.positions.tolist() == [3, 2, 3, 4, 5]
    assert inputs.seq_lens.tolist() == [4, 6]
    assert inputs.sampling_request_ids == ["a", "b"]
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 4]  # b: every verified position
    assert inputs.draft_token_ids == {"b": [23, 24, 25]}
    md = inputs.sampling_metadata
    assert md.output_positions == (1, 1, 2, 3, 4)  # b's seeded noise moves with the position
    assert md.seeds == (None, 3, 3, 3, 3)
    # b keeps 23 and the target's 30 instead of 24: 24 and 25 are overwritten, not kept
    batch.append_sampled(["a", "b"], [[14], [23, 30]])
    assert batch.token_ids("b") == [20, 21, 22, 23, 30]
    assert batch.token_ids("a") == [10, 11, 12, 13, 14]


def test_grammar_rows_of_a_verifying_sequence_follow_its_positions():
    batch, second = _batch_with_drafts([23, 24], grammar_rows=3)
    batch.update(second)
    md = batch.prepare(second).sampling_metadata
    assert md.grammar.rows.tolist() == [1, 2, 3]  # b's rows after a's one
    for i in range(3):
        assert torch.nonzero(md.grammar.banned[i]).flatten().tolist() == [i]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"scheduled_spec_decode_tokens": {"c": [1]}}, "not scheduled"),
        ({"scheduled_spec_decode_tokens": {"b": [1, 100]}}, "outside the vocabulary"),
    ],
)
def test_bad_proposals_are_refused_where_the_plan_is_decoded(change, match):
    batch, second = _batch_with_drafts([])
    with pytest.raises(ValueError, match=match):
        plan_from_pb(plan_to_pb(replace(second, **change)), batch.limits)


def test_proposals_past_max_model_len_are_refused():
    batch, second = _batch_with_drafts([])
    with pytest.raises(InvalidPlanError, match="max_model_len"):
        batch.update(replace(second, scheduled_spec_decode_tokens={"b": list(range(14))}))


def test_proposals_must_all_be_scheduled():
    batch, second = _batch_with_drafts([23, 24])
    batch.update(second)
    # its token and one of its two proposals
    second = replace(second, num_scheduled_tokens={"a": 1, "b": 2}, total_num_scheduled_tokens=3)
    with pytest.raises(InvalidPlanError, match="does not schedule all of them"):
        batch.prepare(second)


# ---- the output distribution -------------------------------------------------------------
V = 8
LOGITS = torch.tensor(
    [
        [1.2, 0.3, -0.4, 2.0, 0.0, -1.0, 0.8, 0.5],  # the first verified position
        [-0.5, 1.5, 0.2, 0.1, 1.1, -0.3, 0.9, -2.0],  # the next one (after the proposal)
    ]
)
NUM_DRAWS = 8_000


def _probs(row: torch.Tensor, temperature: float, top_k: int) -> np.ndarray:
    logits = row / temperature
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    return torch.softmax(logits, -1).double().numpy()


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square test's p-value of the counts against probs (zero-probability
    categories must have no counts)."""
    assert counts[probs == 0].sum() == 0, (counts, probs)
    live = probs > 0
    expected = probs[live] * counts.sum()
    assert expected.min() >= 20  # the test's approximation holds
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    dof = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def _draws(params: dict, proposal: int, seeded: bool):
    return _cached_draws(tuple(sorted(params.items())), proposal, seeded)


@cache
def _cached_draws(params: tuple, proposal: int, seeded: bool):
    """NUM_DRAWS sequences, each verifying one proposal: the kept tokens of each."""
    params = dict(params)
    num = NUM_DRAWS
    batch = InputBatch(4, num, 8, V, None, "cpu")
    ids = [f"r{i}" for i in range(num)]
    news = [
        new_req(rid, [1, 2], [i], seed=i if seeded else None, **params) for i, rid in enumerate(ids)
    ]
    prefill = plan(dict.fromkeys(ids, 2), new=news)
    batch.update(prefill)
    batch.prepare(prefill)
    batch.append_sampled(ids, [[3]] * num)
    verify = plan(dict.fromkeys(ids, 2), cached=[(rid, [], 2, False) for rid in ids])
    verify = replace(verify, scheduled_spec_decode_tokens={rid: [proposal] for rid in ids})
    batch.update(verify)
    inputs = batch.prepare(verify)
    assert inputs.logits_indices.tolist() == list(range(2 * num))
    logits = LOGITS.repeat(num, 1)  # [2 * num, V]: rows 0, 1 of every sequence
    sampler = Sampler(seed=1234)
    out = sampler(logits, inputs.sampling_metadata)
    kept, _ = accept_proposals(out.sampled_token_ids.tolist(), ids, inputs.draft_token_ids)
    return kept


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "shared-generator"])
@pytest.mark.parametrize(
    "params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}], ids=["t1", "t0.7-top5"]
)
def test_verified_tokens_follow_the_targets_distribution(params, seeded):
    temperature, top_k = params["temperature"], params.get("top_k", 0)
    p0 = _probs(LOGITS[0], temperature, top_k)
    p1 = _probs(LOGITS[1], temperature, top_k)
    proposal = int(np.argmax(p0))  # accepted often enough to test what follows it
    kept = _draws(params, proposal, seeded)
    first = np.bincount([k[0] for k in kept], minlength=V)
    accepted = [k for k in kept if k[0] == proposal]
    assert all(len(k) == 2 for k in accepted) and all(len(k) == 1 for k in kept if k[0] != proposal)
    second = np.bincount([k[1] for k in accepted], minlength=V)
    rejected = np.bincount([k[0] for k in kept if k[0] != proposal], minlength=V)
    residual = p0.copy()
    residual[proposal] = 0
    residual /= residual.sum()
    alpha = 1e-4  # the draws are seeded: a fixed outcome, far from the threshold either way
    assert _chi_square_p(first, p0) > alpha, (first, p0)
    assert _chi_square_p(second, p1) > alpha, (second, p1)
    assert _chi_square_p(rejected, residual) > alpha, (rejected, residual)


def test_the_chi_square_check_tells_a_wrong_distribution():
    """The check is sharp enough: the second token's counts are far from row 0's softmax."""
    p0, p1 = _probs(LOGITS[0], 1.0, 0), _probs(LOGITS[1], 1.0, 0)
    kept = _draws({"temperature": 1.0}, int(np.argmax(p0)), seeded=True)
    second = np.bincount([k[1] for k in kept if len(k) == 2], minlength=V)
    assert _chi_square_p(second, p1) > 1e-4
    assert _chi_square_p(second, p0) < 1e-12


def test_seeded_verification_equals_plain_decoding_token_for_token():
    """A seeded sequence's token at output position j does not depend on whether it was
    sampled in a verification row or alone: the noise is keyed by (seed, position)."""
    params = {"temperature": 1.0}
    kept = _draws(params, 3, seeded=True)
    # plain decoding of the first token of each: one row per sequence, output position 1
    num = NUM_DRAWS
    batch = InputBatch(4, num, 8, V, None, "cpu")
    ids = [f"r{i}" for i in range(num)]
    prefill = plan(
        dict.fromkeys(ids, 2), new=[new_req(r, [1, 2], [i], seed=i) for i, r in enumerate(ids)]
    )
    batch.update(prefill)
    batch.prepare(prefill)
    batch.append_sampled(ids, [[3]] * num)
    step = plan(dict.fromkeys(ids, 1), cached=[(rid, [], 2, False) for rid in ids])
    batch.update(step)
    inputs = batch.prepare(step)
    out = Sampler(seed=99)(LOGITS[:1].repeat(num, 1), inputs.sampling_metadata)
    assert out.sampled_token_ids.tolist() == [k[0] for k in kept]


def test_a_plan_with_bad_proposals_changes_nothing():
    """update() is all-or-nothing (services/worker/input_batch.py): a plan refused for its
    proposals leaves the batch as it was, neither its new request nor its deltas applied."""
    batch, second = _batch_with_drafts([])
    bad = replace(
        second,
        scheduled_new_reqs=[new_req("c", [40, 41], [3])],
        num_scheduled_tokens={"a": 1, "b": 1, "c": 2},
        total_num_scheduled_tokens=4,
        finished_req_ids={"gone"},
        scheduled_spec_decode_tokens={"b": list(range(14))},
    )
    with pytest.raises(InvalidPlanError, match="max_model_len"):
        batch.update(bad)
    assert sorted(batch.request_ids) == ["a", "b"]
    assert batch.num_computed_tokens("a") == 0  # the first plan's, not 3
    good, plan_with_drafts = _batch_with_drafts([23])
    good.update(plan_with_drafts)
    with pytest.raises(InvalidPlanError):
        good.update(replace(plan_with_drafts, scheduled_spec_decode_tokens={"b": [1] * 14}))
    inputs = good.prepare(plan_with_drafts)  # the last good plan's proposals, not the bad
    assert inputs.draft_token_ids == {"b": [23]}


def test_proposals_whose_bonus_token_would_not_fit_are_refused():
    """b has 3 tokens; with max_model_len 16, 12 proposals and the target's token after
    them fill it exactly, 13 would leave no room for that token."""
    batch, second = _batch_with_drafts([])
    fits = replace(
        second,
        num_scheduled_tokens={"a": 1, "b": 13},
        total_num_scheduled_tokens=14,
        scheduled_spec_decode_tokens={"b": list(range(12))},
    )
    batch.update(fits)
    with pytest.raises(InvalidPlanError, match="max_model_len"):
        batch.update(replace(fits, scheduled_spec_decode_tokens={"b": list(range(13))}))
