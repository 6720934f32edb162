"""Greedy outputs with speculative decoding equal those without, token for token, in
float32 on the tiny llama (and the default model): both methods (n-gram, and the target
as its own draft, which must accept every proposal), over chunked prefill, prefix hits,
preemption in both modes (also near the cache-capped max_model_len, with async
scheduling), and max_tokens ending inside an accepted run."""

from __future__ import annotations

import random

import pytest

from pagestream import LLM, SamplingParams
from tests.helpers.spec_decode import (
    METHODS,
    assert_same_outputs,
    check_method_stats,
    copy_heavy_prompts,
    spec_config,
    spec_stats,
)


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _greedy(count: int, base: int = 20) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=base + i % 5) for i in range(count)]


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("llama")


@pytest.mark.parametrize("method", METHODS)
def test_chunked_prefill_and_prefix_hits(folder, method):
    args = dict(
        kv_cache_memory="8MiB",
        block_size=8,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
    )
    prompts = copy_heavy_prompts(seed=1)
    params = _greedy(len(prompts))
    plain = LLM(str(folder), **args)
    reference = _generate(plain, prompts, params)
    llm = LLM(str(folder), speculative_config=spec_config(method, folder), **args)
    outputs = _generate(llm, prompts, params)
    assert_same_outputs(reference, outputs, folder, prompts)
    check_method_stats(llm, method)
    stats = llm.engine.scheduler.get_stats()
    assert stats.prefix_cache_hits > 0  # the shared prefix and the repeated prompt
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.cache_info.num_device_blocks
    # the same engine again: the prefix cache now holds every prompt's blocks
    again = _generate(llm, prompts, params)
    assert_same_outputs(reference, again, folder, prompts)


# 12 blocks of 4 tokens (a draft model's cache doubles a block's bytes) for 12 requests
# that grow to ~32 tokens each: preemption is certain.
KV_12_BLOCKS = {"ngram": 24576, "draft_model": 49152}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", METHODS)
def test_preemption_in_both_modes(folder, method, mode):
    args = dict(
        block_size=4,
        swap_space=0.01,
        preemption_mode=mode,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    prompts = [p[:20] for p in copy_heavy_prompts(seed=2)] + copy_heavy_prompts(seed=3)[:4]
    params = _greedy(len(prompts), base=10)
    plain = LLM(str(folder), kv_cache_memory=24576, **args)
    reference = _generate(plain, prompts, params)
    llm = LLM(
        str(folder),
        kv_cache_memory=KV_12_BLOCKS[method],
        speculative_config=spec_config(method, folder),
        **args,
    )
    assert llm.engine.cache_info.num_device_blocks == 12
    outputs = _generate(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_outputs(reference, outputs, folder, prompts)
    check_method_stats(llm, method)
    assert llm.engine.scheduler.kv.num_free_blocks == 12
    if mode == "swap":
        assert len(llm.engine.scheduler.kv.cpu_free) == llm.engine.cache_info.num_cpu_blocks


def _near_cap_prompts(seed: int, count: int, max_len: int) -> list[list[int]]:
    """Fresh prompts and self-repeating ones, 20 to max_len tokens long."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        length = rng.randrange(20, max_len + 1)
        if i % 2:
            period = [rng.randrange(3, 500) for _ in range(length // 3)]
            prompts.append((period * 4)[:length])
        else:
            prompts.append([rng.randrange(3, 500) for _ in range(length)])
    return prompts


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_near_the_capped_max_model_len(folder, mode):
    """The issue's shape: 32 requests of max_tokens 24 over 24 blocks of 4 (max_model_len is
    capped at the cache's 96 tokens), prompts of up to 92 tokens, the target as its own
    draft, with async scheduling, chunked prefill and prefix caching on top of preemption:
    every request ends as in the plain run of the same blocks, those the cap ends
    included, and none ends earlier."""
    args = dict(
        block_size=4,
        swap_space=0.01,
        preemption_mode=mode,
        async_scheduling=True,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        enable_prefix_caching=True,
    )
    prompts = _near_cap_prompts(seed=5, count=32, max_len=92)
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(str(folder), kv_cache_memory=KV_12_BLOCKS["ngram"] * 2, **args)
    reference = _generate(plain, prompts, params)
    llm = LLM(
        str(folder),
        kv_cache_memory=KV_12_BLOCKS["draft_model"] * 2,
        speculative_config=spec_config("draft_model", folder),
        **args,
    )
    scheduler = llm.engine.scheduler
    assert llm.engine.cache_info.num_device_blocks == 24 and scheduler.max_model_len == 96
    outputs = _generate(llm, prompts, params)
    assert scheduler.num_preemptions > 0
    assert_same_outputs(reference, outputs, folder, prompts)
    capped = [
        out
        for out, prompt in zip(outputs, prompts, strict=True)
        if len(prompt) + len(out.outputs[0].token_ids) == 96
    ]
    assert capped and all(out.outputs[0].finish_reason == "length" for out in capped)
    check_method_stats(llm, "draft_model")
    assert scheduler.kv.num_free_blocks == 24
    if mode == "swap":
        assert len(scheduler.kv.cpu_free) == llm.engine.cache_info.num_cpu_blocks


def test_max_tokens_ending_inside_an_accepted_run(folder):
    """The target as its own draft with k = 3 accepts runs of 4; max_tokens 1 + 4 + 4 + r
    (r = 1, 2, 3) end inside a run: exactly max_tokens tokens, finish reason length."""
    prompts = copy_heavy_prompts(seed=4)[:6]
    params = [
        SamplingParams(temperature=0, max_tokens=9 + i % 3 + 1, ignore_eos=True) for i in range(6)
    ]
    plain = LLM(str(folder), kv_cache_memory="8MiB")
    reference = _generate(plain, prompts, params)
    llm = LLM(
        str(folder), kv_cache_memory="8MiB", speculative_config=spec_config("draft_model", folder)
    )
    outputs = _generate(llm, prompts, params)
    assert_same_outputs(reference, outputs, folder, prompts)
    for out, sp in zip(outputs, params, strict=True):
        assert len(out.outputs[0].token_ids) == sp.max_tokens
        assert out.outputs[0].finish_reason == "length"
    stats = spec_stats(llm)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    # the last step of each was capped below k: not every draft has 3 proposals
    assert stats.spec_decode_num_draft_tokens < 3 * stats.spec_decode_num_drafts


@pytest.mark.slow
def test_the_default_model_with_ngram_speculation():
    """SmolLM2-135M asked to copy lines: the n-gram's proposals are accepted, and the
    outputs equal the plain run's."""
    lines = [
        "the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the dog.",
        "Paged attention stores keys and values in fixed-size blocks. Paged attention stores "
        "keys and values in fixed-size blocks.",
    ]
    conversations = [[{"role": "user", "content": f"Copy this text: {line}"}] for line in lines]
    params = SamplingParams(temperature=0, max_tokens=40)
    llm = LLM(speculative_config=spec_config("ngram", "", k=4), kv_cache_memory="128MiB")
    # The reference from the same engine (one load of the model): the n-gram proposer
    # only adds proposals, so without it the engine decodes plainly.
    runner = llm.engine.worker.runner
    proposer, runner.proposer = runner.proposer, None
    reference = llm.chat(conversations, params, use_tqdm=False)
    assert spec_stats(llm).spec_decode_num_draft_tokens == 0
    runner.proposer = proposer
    assert llm.engine.scheduler.kv.reset_prefix_cache()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    assert_same_outputs(reference, outputs, None)
    stats = spec_stats(llm)
    assert stats.spec_decode_num_accepted_tokens >= 16, stats
    assert "fixed-size blocks" in outputs[1].outputs[0].text
