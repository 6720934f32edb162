"""LLM(model, tensor_parallel_size=2) over gloo (two local worker processes, the mp
backend) gives the greedy outputs of tp = 1 and of HF transformers on a tiny Llama with
4 query / 2 KV heads: mixed batches with chunked prefill, prefix hits, preemption by
recompute and by swap, n > 1 with copy-on-write and beam search.

One worker group for the whole module (process groups take seconds to start)."""

import pytest

from pagestream import LLM, SamplingParams
from services.common.sampling_params import BeamSearchParams
from tests.helpers.parallel import (
    assert_same_or_near_tie,
    generate_ids,
    greedy_params,
    mixed_prompts,
    set_preemption_mode,
)

# 12 blocks of 4 tokens per rank at tp = 2 (one KV head of 16 dims, 2 layers, float32).
ENGINE = dict(
    dtype="float32",
    block_size=4,
    kv_cache_memory=12 * 1024,
    swap_space=0.01,
    max_num_batched_tokens=48,
)


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def tp2(folder):
    llm = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def tp1(folder):
    # Same number of blocks as tp = 2 (each tp = 1 block holds both KV heads).
    return LLM(str(folder), **{**ENGINE, "kv_cache_memory": 24 * 1024})


def test_the_group_holds_the_same_blocks_as_one_worker(tp2, tp1):
    assert tp2.engine.cache_info.num_device_blocks == tp1.engine.cache_info.num_device_blocks == 12
    info = tp2.engine.model_info
    assert (info.world_size, info.tensor_parallel_size, info.pipeline_parallel_size) == (2, 2, 1)
    assert info.num_kv_heads == 1  # each rank holds one of the two KV heads


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mixed_batch_with_prefix_hits_and_preemption(tp2, tp1, folder, hf_greedy, mode):
    set_preemption_mode(tp2, mode)
    set_preemption_mode(tp1, mode)
    prompts = [p[:28] for p in mixed_prompts(10, seed=3)]  # each fits in 12 blocks
    params = greedy_params(len(prompts), max_tokens=8)
    preemptions = tp2.engine.scheduler.num_preemptions
    got = generate_ids(tp2, prompts, params)
    assert tp2.engine.scheduler.num_preemptions > preemptions  # 12 blocks: it had to preempt
    assert tp2.engine.scheduler.get_stats().prefix_cache_hits > 0
    assert tp2.engine.scheduler.kv.num_free_blocks == 12
    reference = generate_ids(tp1, prompts, params)
    for prompt, sp, out, ref in zip(prompts, params, got, reference, strict=True):
        expected = hf_greedy(folder, prompt, sp.max_tokens)
        if 2 in expected:  # HF stops at EOS (id 2) too
            expected = expected[: expected.index(2) + 1]
        assert_same_or_near_tie(folder, prompt, ref, expected)
        assert_same_or_near_tie(folder, prompt, out, ref)


def test_n_samples_share_blocks_and_match_one_worker(tp2, tp1):
    set_preemption_mode(tp2, "recompute")
    set_preemption_mode(tp1, "recompute")
    prompt = {"prompt_token_ids": mixed_prompts(1, seed=5)[0][:14]}  # a partial last block
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=6)
    got = tp2.generate(prompt, params, use_tqdm=False)[0]
    expected = tp1.generate(prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in expected.outputs]
    assert len({tuple(o.token_ids) for o in got.outputs}) > 1  # really three samples


def test_beam_search_matches_one_worker(tp2, tp1):
    prompts = [{"prompt_token_ids": p[:12]} for p in mixed_prompts(2, seed=7)]
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    got = tp2.beam_search(prompts, params)
    expected = tp1.beam_search(prompts, params)
    for g, e in zip(got, expected, strict=True):
        assert len(g.outputs) == 3
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in e.outputs]
        cumulative = [o.cumulative_logprob for o in g.outputs]
        assert cumulative == pytest.approx([o.cumulative_logprob for o in e.outputs], abs=1e-4)
