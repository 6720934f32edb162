"""InputBatch: plan diffs, the flattened batch layout, sampling rows, errors."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from services.common.convert.step import plan_from_pb, plan_to_pb
from services.common.scheduler_output import CachedRequestData, SchedulerOutput
from services.worker.input_batch import InputBatch, InvalidPlanError, UnknownRequestError
from tests.helpers.scheduler_plans import new_req, plan

BLOCK_SIZE = 4
VOCAB_SIZE = 100


def make_batch(max_num_seqs: int = 8, max_model_len: int = 32) -> InputBatch:
    return InputBatch(BLOCK_SIZE, max_num_seqs, max_model_len, VOCAB_SIZE, 2, "cpu")


def step1() -> SchedulerOutput:
    """A chunked prefill, a prefix-hit prefill and a request resumed with outputs."""
    return plan(
        {"a": 6, "b": 1, "c": 5},
        new=[
            new_req("a", range(10, 20), [7, 3, 9]),
            new_req("b", range(20, 25), [5, 6], computed=4, temperature=0.0),
            new_req("c", [30, 31, 32], [2, 8], output=[33, 34], seed=11, min_tokens=3),
        ],
    )


def assert_tensor(tensor: torch.Tensor, values, dtype) -> None:
    assert tensor.dtype == dtype
    assert tensor.tolist() == values


def test_hand_made_plan_with_chunked_prefill_and_decodes():
    batch = make_batch()
    first = step1()
    batch.update(first)
    inputs = batch.prepare(first)
    assert inputs.request_ids == ["a", "b", "c"]
    assert_tensor(inputs.input_ids, [10, 11, 12, 13, 14, 15, 24, 30, 31, 32, 33, 34], torch.int64)
    assert_tensor(inputs.positions, [0, 1, 2, 3, 4, 5, 4, 0, 1, 2, 3, 4], torch.int64)
    slots = [28, 29, 30, 31, 12, 13, 24, 8, 9, 10, 11, 32]
    assert_tensor(inputs.slot_mapping[0], slots, torch.int64)
    assert_tensor(inputs.query_start_loc, [0, 6, 7, 12], torch.int32)
    assert_tensor(inputs.seq_lens, [6, 5, 5], torch.int32)
    assert_tensor(inputs.block_table[0], [[7, 3, 9], [5, 6, 0], [2, 8, 0]], torch.int32)
    assert (inputs.max_query_len, inputs.max_seq_len, inputs.num_tokens) == (6, 6, 12)
    # "a" is mid-prefill: only the caught-up requests sample.
    assert inputs.sampling_request_ids == ["b", "c"]
    assert_tensor(inputs.logits_indices, [6, 11], torch.int64)
    md = inputs.sampling_metadata
    assert md.seeds == (None, 11) and md.output_positions == (0, 2)
    assert md.temperature.tolist() == [0.0, 1.0] and not md.all_greedy and not md.all_random
    # min_tokens=3 with 2 outputs: EOS (2) is banned for row 1.
    assert md.min_tokens_mask.rows.tolist() == [1] and md.min_tokens_mask.token_ids.tolist() == [2]

    batch.append_sampled(["b", "c"], [[40], [41]])
    second = plan(
        {"a": 4, "b": 1, "c": 1},
        cached=[("a", [], 6, False), ("b", [], 5, False), ("c", [11], 5, False)],
    )
    batch.update(second)
    inputs = batch.prepare(second)
    assert_tensor(inputs.input_ids, [16, 17, 18, 19, 40, 41], torch.int64)
    assert_tensor(inputs.positions, [6, 7, 8, 9, 5, 5], torch.int64)
    assert_tensor(inputs.slot_mapping[0], [14, 15, 36, 37, 25, 33], torch.int64)
    assert_tensor(inputs.block_table[0], [[7, 3, 9], [5, 6, 0], [2, 8, 11]], torch.int32)
    assert inputs.sampling_request_ids == ["a", "b", "c"]
    assert_tensor(inputs.logits_indices, [3, 4, 5], torch.int64)
    assert inputs.sampling_metadata.output_positions == (0, 1, 3)


def test_diffs_applied_across_plans():
    batch = make_batch()
    batch.update(step1())
    batch.append_sampled(["b", "c"], [[40], [41]])
    batch.update(
        plan(
            {"a": 4, "b": 1, "c": 1},
            cached=[("a", [], 6, False), ("b", [], 5, False), ("c", [11], 5, False)],
        )
    )
    batch.append_sampled(["a", "b", "c"], [[50], [51], [52]])
    assert batch.block_table("c") == ([2, 8, 11],)
    # b finishes; c comes back from swap with a whole new table; a decodes.
    third = plan({"a": 1, "c": 1}, cached=[("a", [], 10, False), ("c", [12, 13], 6, True)],
                 finished={"b", "never-seen"})  # fmt: skip
    batch.update(third)
    assert "b" not in batch and len(batch) == 2
    assert batch.block_table("c") == ([12, 13],) and batch.num_computed_tokens("c") == 6
    assert batch.token_ids("c") == [30, 31, 32, 33, 34, 41, 52]
    assert batch.num_prompt_tokens("c") == 3
    inputs = batch.prepare(third)
    assert_tensor(inputs.input_ids, [50, 52], torch.int64)
    assert_tensor(inputs.slot_mapping[0], [9 * 4 + 2, 13 * 4 + 2], torch.int64)
    assert_tensor(inputs.block_table[0], [[7, 3, 9], [12, 13, 0]], torch.int32)
    # b comes back as a new request (recompute preemption) and reuses a free slot.
    fourth = plan({"b": 7}, new=[new_req("b", range(20, 25), [1, 4], output=[51, 53])])
    batch.update(fourth)
    assert batch.token_ids("b") == [20, 21, 22, 23, 24, 51, 53]
    assert batch.block_table("b") == ([1, 4],) and batch.num_computed_tokens("b") == 0
    assert batch.prepare(fourth).sampling_request_ids == ["b"]


def test_unknown_request_ids_raise_and_change_nothing():
    batch = make_batch()
    batch.update(step1())
    bad = plan(
        {"zzz": 1},
        new=[new_req("d", [1, 2], [4])],
        cached=[("zzz", [], 3, False)],
        finished={"a"},
    )
    with pytest.raises(UnknownRequestError) as error:
        batch.update(bad)
    assert error.value.request_id == "zzz" and isinstance(error.value, ValueError)
    assert sorted(batch.request_ids) == ["a", "b", "c"]  # "a" kept, "d" not added
    with pytest.raises(UnknownRequestError):  # a delta for a request finished in that plan
        batch.update(plan({}, cached=[("a", [], 6, False)], finished={"a"}))
    with pytest.raises(UnknownRequestError):
        batch.prepare(plan({"zzz": 1}))
    with pytest.raises(UnknownRequestError):
        batch.append_sampled(["b", "zzz"], [[1], [2]])
    assert batch.token_ids("b") == [20, 21, 22, 23, 24]


def test_inconsistent_plans_raise_invalid_plan_error():
    batch = make_batch()
    batch.update(step1())
    with pytest.raises(InvalidPlanError, match="past its known token ids"):
        batch.prepare(plan({"b": 2}))  # b has 5 tokens, 4 computed
    short = plan({"s": 6}, new=[new_req("s", range(6), [1])])
    batch.update(short)
    with pytest.raises(InvalidPlanError, match="block table"):
        batch.prepare(short)  # 6 tokens need 2 blocks of 4
    with pytest.raises(InvalidPlanError, match="blocks"):
        batch.update(plan({}, cached=[("a", list(range(20, 26)), 6, False)]))


def test_plans_from_the_wire_are_checked_against_the_worker_limits():
    """What the plan alone shows is checked once, where it is decoded: a request past
    max_model_len, a row scheduling no token (the total is the decoder's own sum)."""
    batch = make_batch()
    with pytest.raises(ValueError, match="tokens"):
        plan_from_pb(plan_to_pb(plan({"x": 1}, new=[new_req("x", range(33), [1])])), batch.limits)
    with pytest.raises(ValueError, match="fewer than 1 token"):
        plan_from_pb(plan_to_pb(plan({"a": 0}, new=[new_req("a", range(4), [1])])))
    with pytest.raises(ValueError, match="blocks per KV cache group"):
        plan_from_pb(
            plan_to_pb(plan({"y": 4}, new=[new_req("y", range(4), range(9))])), batch.limits
        )
    wire = plan_from_pb(plan_to_pb(step1()), batch.limits)
    assert wire.total_num_scheduled_tokens == sum(wire.num_scheduled_tokens.values()) == 12


def reference_layout(requests, block_size):
    """Per-token Python loops: (input_ids, positions, slot_mapping)."""
    ids, positions, slots = [], [], []
    for tokens, blocks, computed, scheduled in requests:
        for pos in range(computed, computed + scheduled):
            ids.append(tokens[pos])
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    return ids, positions, slots


def test_random_batches_match_per_token_reference():
    rng = np.random.default_rng(0)
    batch = InputBatch(BLOCK_SIZE, 4, 64, VOCAB_SIZE, None, "cpu")
    requests, new, scheduled = [], [], {}
    for i in range(12):  # grows past max_num_seqs=4
        num_tokens = int(rng.integers(1, 64))
        tokens = rng.integers(0, VOCAB_SIZE, num_tokens).tolist()
        blocks = rng.permutation(100)[: -(-num_tokens // BLOCK_SIZE)].tolist()
        computed = int(rng.integers(0, num_tokens))
        count = int(rng.integers(1, num_tokens - computed + 1))
        requests.append((tokens, blocks, computed, count))
        new.append(new_req(f"r{i}", tokens, blocks, computed=computed))
        scheduled[f"r{i}"] = count
    step = plan(scheduled, new=new)
    batch.update(step)
    inputs = batch.prepare(step)
    ids, positions, slots = reference_layout(requests, BLOCK_SIZE)
    assert inputs.input_ids.tolist() == ids
    assert inputs.positions.tolist() == positions
    assert inputs.slot_mapping[0].tolist() == slots
    samples = [f"r{i}" for i, (t, _, c, n) in enumerate(requests) if c + n == len(t)]
    assert inputs.sampling_request_ids == samples


def test_prompt_logprobs_rows_cover_prompt_targets_across_chunks():
    batch = make_batch()
    prompt = list(range(10, 20))
    first = plan({"p": 6}, new=[new_req("p", prompt, [1, 2, 3], prompt_logprobs=2)])
    batch.update(first)
    rows = batch.prepare(first).prompt_logprobs
    assert rows.request_ids == ["p"] and rows.first_positions == [1] and rows.num_rows == [6]
    assert rows.token_indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert rows.target_ids.tolist() == prompt[1:7] and rows.max_num_logprobs == 2
    second = plan({"q": 1, "p": 4}, new=[new_req("q", [5], [4])], cached=[("p", [], 6, False)])
    batch.update(second)
    rows = batch.prepare(second).prompt_logprobs
    assert rows.first_positions == [7] and rows.token_indices.tolist() == [1, 2, 3]
    assert rows.target_ids.tolist() == prompt[7:10]


def test_penalty_token_ids_and_sampling_columns_follow_row_order():
    batch = make_batch()
    step = plan(
        {"x": 1, "y": 1},
        new=[
            new_req("x", [5, 6], [1], computed=1, output=[], presence_penalty=1.0),
            new_req("y", [7], [2], computed=2, output=[8, 9], temperature=0.0, logprobs=3),
        ],
    )
    batch.update(step)
    md = batch.prepare(step).sampling_metadata
    assert md.prompt_token_ids.tolist() == [[5, 6], [7, VOCAB_SIZE]]
    assert md.output_token_ids.tolist() == [[VOCAB_SIZE, VOCAB_SIZE], [8, 9]]
    assert md.presence_penalty.tolist() == [1.0, 0.0]
    assert md.num_logprobs == (None, 3) and md.max_num_logprobs == 3


def test_prepare_256_decodes_is_fast():
    batch = InputBatch(16, 256, 2048, 32000, 2, "cpu")
    new = [
        new_req(f"r{i}", range(1, 101), range(8 * i, 8 * i + 8), computed=99) for i in range(256)
    ]
    step = plan({f"r{i}": 1 for i in range(256)}, new=new)
    batch.update(step)
    timings = []
    for _ in range(20):
        start = time.perf_counter()
        inputs = batch.prepare(step)
        timings.append(time.perf_counter() - start)
    assert inputs.num_tokens == 256 and len(inputs.sampling_request_ids) == 256
    assert inputs.slot_mapping[0, 5].item() == (5 * 8 + 99 // 16) * 16 + 99 % 16
    assert float(np.median(timings)) < 0.02  # measured ~1 ms on one CPU core


def test_empty_plan_gives_an_empty_batch():
    batch = make_batch()
    batch.update(step1())
    inputs = batch.prepare(SchedulerOutput())
    assert inputs.num_tokens == 0 and inputs.request_ids == []
    assert inputs.input_ids.shape == (0,) and tuple(inputs.block_table.shape) == (1, 0, 0)
    assert inputs.sampling_metadata is None and inputs.prompt_logprobs is None


def _decode_plan(request_id: str, num_computed: int, new_tokens: list[int]) -> SchedulerOutput:
    cached = CachedRequestData([request_id], [([],)], [num_computed], [False], [new_tokens])
    return SchedulerOutput(
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={request_id: 1},
        total_num_scheduled_tokens=1,
    )


def test_a_rank_that_does_not_sample_learns_the_tokens_from_the_plan():
    """Two ranks of a worker group: only `sampler` appends what it sampled; `follower`
    gets the same tokens through the plan's output tail, and both decode the same ids."""
    sampler, follower = make_batch(), make_batch()
    first = plan({"a": 5}, new=[new_req("a", range(10, 15), [1, 2])])
    for batch in (sampler, follower):
        batch.update(first)
    sampler.append_sampled(["a"], [[77]])
    for step, token in enumerate([77, 78, 79]):
        if step:
            sampler.append_sampled(["a"], [[token]])
        decode = _decode_plan("a", 5 + step, [token])
        for batch in (sampler, follower):
            batch.update(decode)
            assert batch.token_ids("a") == [*range(10, 15), *[77, 78, 79][: step + 1]]
            assert batch.prepare(decode).input_ids.tolist() == [token]


def test_an_output_tail_past_max_model_len_is_refused():
    batch = make_batch(max_model_len=8)
    batch.update(plan({"a": 5}, new=[new_req("a", range(10, 15), [1, 2])]))
    with pytest.raises(InvalidPlanError, match="max_model_len"):
        batch.update(_decode_plan("a", 5, [1, 2, 3, 4]))
    assert batch.token_ids("a") == list(range(10, 15))  # nothing changed
