"""Greedy outputs of the whole engine equal HF transformers' generate, token for token,
across batch compositions, chunked prefill, prefix hits and preemption (float32)."""

import random

import pytest

from pagestream import LLM, SamplingParams
from tests.helpers.tiny_models import MOE_FAMILIES


def _prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Mixed lengths; a third share one long prefix, a third another, the rest are fresh."""
    rng = random.Random(seed)
    shared = [
        [rng.randrange(3, 500) for _ in range(40)],
        [rng.randrange(3, 500) for _ in range(23)],
    ]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
        prompts.append(shared[i % 3] + tail if i % 3 < 2 else tail + [7] * (i % 5))
    return prompts


def _check(llm, folder, hf_greedy, prompts, max_tokens):
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens + i % 4) for i in range(len(prompts))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outputs, strict=True):
        expected = hf_greedy(folder, prompt, sp.max_tokens)
        if 2 in expected:  # HF stops at EOS (id 2) too
            expected = expected[: expected.index(2) + 1]
        assert out.outputs[0].token_ids == expected, (prompt, out.outputs[0].token_ids, expected)
    return outputs


@pytest.mark.parametrize(
    "name", ["llama", "qwen2", "qwen3", "smollm3", "gemma3", "phi4", *MOE_FAMILIES]
)
def test_batch_with_chunked_prefill_and_prefix_hits(model_dir, hf_greedy, name):
    folder = model_dir(name)
    llm = LLM(str(folder), kv_cache_memory="16MiB", max_num_batched_tokens=48, block_size=16)
    prompts = _prompts(llm.get_tokenizer(), 33, seed=1)
    outputs = _check(llm, folder, hf_greedy, prompts, max_tokens=10)
    assert sum(o.num_cached_tokens for o in outputs) >= 16 * 10  # shared prefixes were hits
    stats = llm.engine.scheduler.get_stats()
    assert stats.prefix_cache_hits > 0
    assert stats.kv_cache_usage == 0.0 or llm.engine.scheduler.kv.num_free_blocks > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_parity(model_dir, hf_greedy, mode):
    folder = model_dir("llama")
    # 12 blocks of 4 tokens for 12 requests that each grow to ~30 tokens: preemption is certain.
    llm = LLM(
        str(folder),
        block_size=4,
        kv_cache_memory=24576,  # exactly 12 blocks of this model (asserted below)
        swap_space=0.01,
        preemption_mode=mode,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    assert llm.engine.cache_info.num_device_blocks == 12
    prompts = _prompts(llm.get_tokenizer(), 12, seed=2)
    prompts = [p[:20] for p in prompts]
    _check(llm, folder, hf_greedy, prompts, max_tokens=12)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.num_free_blocks == 12
