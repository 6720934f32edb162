"""A model whose every layer attends within a sliding window (the tiny Mistral: 6 tokens,
blocks of 4) run far past its window: blocks wholly outside the window are freed as each
sequence grows, so a sequence holds a bounded number of blocks however long it gets, and
the greedy outputs stay HF's token for token, with chunked prefill, prefix hits and
preemption by recompute and by swap."""

import random

import pytest

from pagestream import LLM, SamplingParams
from services.scheduler.kv_cache_manager import NULL_BLOCK
from tests.helpers.parallel import assert_same_or_near_tie

BLOCK = 4
BUDGET = 16  # max_num_batched_tokens: the chunk a prompt is prefilled in


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Two thirds share a 24-token prefix (prefix hits), lengths 28-60."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(24)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 36))]
        prompts.append(shared + tail if i % 3 else tail + shared)
    return prompts


def _engine(folder, mode: str, blocks: int, backend: str = "auto") -> LLM:
    return LLM(
        str(folder),
        attention_backend=backend,
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory=blocks * BLOCK * 2 * 2 * 2 * 16 * 4,  # K and V, 2 layers, 2 heads of 16
        max_num_batched_tokens=BUDGET,
        preemption_mode=mode,
        swap_space=0.01,
    )


def _assert_hf(folder, hf_greedy, prompt, got, max_tokens) -> None:
    expected = hf_greedy(folder, prompt, max_tokens)
    if 2 in expected:  # HF stops at EOS (id 2) too
        expected = expected[: expected.index(2) + 1]
    assert_same_or_near_tie(folder, prompt, list(got), expected)


def _record_held_blocks(llm, monkeypatch) -> list[int]:
    kv = llm.engine.scheduler.kv
    held: list[int] = []
    allocate = kv.allocate_slots

    def recording(request, *args, **kwargs):
        blocks = allocate(request, *args, **kwargs)
        held.append(kv.num_held_blocks(request.request_id))
        return blocks

    monkeypatch.setattr(kv, "allocate_slots", recording)
    return held


@pytest.mark.parametrize(
    ("mode", "blocks", "backend"),
    [
        ("recompute", 64, "auto"),
        ("recompute", 20, "auto"),
        ("swap", 20, "auto"),
        ("swap", 20, "torch"),  # the torch kernels read the freed entries' block, masked
    ],
)
def test_far_past_the_window_blocks_are_bounded_and_outputs_equal_hf(
    model_dir, hf_greedy, monkeypatch, mode, blocks, backend
):
    folder = model_dir("mistral")
    llm = _engine(folder, mode, blocks, backend)
    kv = llm.engine.scheduler.kv
    assert llm.engine.cache_info.num_device_blocks == blocks
    assert kv.sliding_window == 6
    peak = kv.peak_blocks(10**6)
    assert peak == -(-(6 - 1 + BUDGET) // BLOCK) + 1 == 7
    held = _record_held_blocks(llm, monkeypatch)
    prompts = _prompts(9, seed=blocks)
    params = SamplingParams(temperature=0, max_tokens=70)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        # each sequence reaches ~100 tokens (25 blocks) against its peak of 7
        _assert_hf(folder, hf_greedy, prompt, out.outputs[0].token_ids, 70)
    assert max(held) <= peak
    assert kv.num_free_blocks == blocks  # every block back
    assert not kv.num_nulled and not kv.req_to_blocks
    stats = llm.engine.scheduler.get_stats()
    assert stats.prefix_cache_hits > 0
    if blocks < 9 * peak:  # nine sequences cannot all hold their peak: preemption ran
        assert llm.engine.scheduler.num_preemptions > 0
    else:  # without freeing 9 x 25 blocks would not fit in 64
        assert llm.engine.scheduler.num_preemptions == 0


def test_a_prompt_longer_than_the_cache_is_served_within_its_window(model_dir, hf_greedy):
    """200 tokens need 50 blocks; 12 hold its window and a chunk."""
    folder = model_dir("mistral")
    llm = _engine(folder, "recompute", 12)
    prompt = [random.Random(5).randrange(3, 500) for _ in range(200)]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8))
    _assert_hf(folder, hf_greedy, prompt, out[0].outputs[0].token_ids, 8)
    assert llm.engine.scheduler.max_model_len == 256  # the model's, not the cache's 48


def test_the_null_entry_is_never_freed_or_cached():
    assert NULL_BLOCK.ref_cnt > 1 << 40 and NULL_BLOCK.block_hash is None


@pytest.mark.parametrize(
    ("mode", "backend"), [("recompute", "auto"), ("swap", "auto"), ("swap", "torch")]
)
def test_a_hybrid_model_frees_its_windowed_layers_blocks_and_equals_hf(
    model_dir, hf_greedy, monkeypatch, mode, backend
):
    """The tiny Gemma 3 (sliding, full, sliding; a 6-token window): three KV cache groups
    of one layer each, so a block costs one layer's KV; the full group keeps every block,
    the two windowed groups their window's, and outputs stay HF's."""
    folder = model_dir("gemma3")
    bytes_per_block = 2 * BLOCK * 2 * 32 * 4  # K and V, one layer, 2 heads of 32, float32
    llm = LLM(
        str(folder),
        attention_backend=backend,
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory=64 * bytes_per_block,
        max_num_batched_tokens=BUDGET,
        preemption_mode=mode,
        swap_space=0.01,
    )
    assert llm.engine.cache_info.bytes_per_block == bytes_per_block
    kv = llm.engine.scheduler.kv
    assert (kv.num_groups, kv.windowed, kv.sliding_window) == (3, (1, 2), 6)
    window_peak = -(-(6 - 1 + BUDGET) // BLOCK) + 1
    allocate, seen = kv.allocate_slots, []

    def recording(request, *args, **kwargs):
        blocks = allocate(request, *args, **kwargs)
        rid = request.request_id
        positions = len(kv.block_table(rid)[0])
        seen.append((kv.num_held_blocks(rid), positions, kv.num_nulled.get(rid, 0)))
        return blocks

    monkeypatch.setattr(kv, "allocate_slots", recording)
    prompts = _prompts(9, seed=3)
    params = SamplingParams(temperature=0, max_tokens=70)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        _assert_hf(folder, hf_greedy, prompt, out.outputs[0].token_ids, 70)
    # the full group holds each position, the windowed ones at most their peak
    assert all(held <= positions + 2 * window_peak for held, positions, _ in seen)
    assert max(nulled for *_, nulled in seen) > 20  # ~100 tokens past a 6-token window
    assert kv.num_free_blocks == 64 and not kv.num_nulled and not kv.req_to_blocks
    assert llm.engine.scheduler.get_stats().prefix_cache_hits > 0
    assert llm.engine.scheduler.num_preemptions > 0  # 9 x (33 + 14) blocks exceed 64
