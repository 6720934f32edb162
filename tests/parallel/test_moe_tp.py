"""A mixture of experts at tp = 2 (gloo, the mp backend) gives HF transformers' greedy
outputs both ways its experts can be placed: each expert split over the ranks like the
dense MLP, and with enable_expert_parallel whole experts per rank (3 of Qwen2-MoE's 6
each). The tiny Qwen2-MoE has a dense layer, a sparse one and a shared expert; mixed
batches with chunked prefill and prefix hits.

One worker group at a time (the fixture's two placements run one after the other)."""

import pytest

from pagestream import LLM
from tests.helpers.parallel import (
    assert_same_or_near_tie,
    generate_ids,
    greedy_params,
    mixed_prompts,
)

ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("qwen2_moe")


@pytest.fixture(scope="module", params=[False, True], ids=["experts-split", "expert-parallel"])
def tp2(request, folder):
    llm = LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=request.param, **ENGINE)
    yield llm
    llm.engine.close()


def test_greedy_outputs_equal_hf(tp2, folder, hf_greedy):
    prompts = [p[:28] for p in mixed_prompts(9, seed=4)]
    params = greedy_params(len(prompts), max_tokens=8)
    got = generate_ids(tp2, prompts, params)
    assert tp2.engine.scheduler.get_stats().prefix_cache_hits > 0
    for prompt, sp, out in zip(prompts, params, got, strict=True):
        expected = hf_greedy(folder, prompt, sp.max_tokens)
        if 2 in expected:  # HF stops at EOS (id 2) too
            expected = expected[: expected.index(2) + 1]
        assert_same_or_near_tie(folder, prompt, out, expected)
