"""The pooling runner in a worker group: LLM(runner="pooling") with tensor_parallel_size=2
or pipeline_parallel_size=2 over gloo (the mp backend) embeds as HF AutoModel does (MEAN
pooling, float32), chunked, beside generation requests, whose tokens stay HF's; only the
output rank pools.

One worker group per layout for the whole module (process groups take seconds to start)."""

from __future__ import annotations

import numpy as np
import pytest

from pagestream import LLM, PoolingParams, SamplingParams
from tests.helpers.engine_steps import run_until_done
from tests.helpers.hf_pooling import cosine, hf_pooled

PROMPTS = [[5, 17, 33, 99, 250, 12, 8, 41, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 4, 5, 6]]


@pytest.fixture(scope="module", params=["tp2", "pp2"])
def group(model_dir, request):
    layout = {"tp2": "tensor_parallel_size", "pp2": "pipeline_parallel_size"}[request.param]
    llm = LLM(
        str(model_dir("llama")),
        **{layout: 2},
        runner="pooling",
        pooler_config={"pooling_type": "MEAN"},
        dtype="float32",
        kv_cache_memory="4MiB",
        max_num_batched_tokens=8,
    )
    yield llm
    llm.engine.close()


def test_group_embeddings_equal_hf_beside_generation(group, model_dir, hf_greedy):
    folder = model_dir("llama")
    engine = group.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gen = engine.add_request(None, {"prompt_token_ids": PROMPTS[1]}, greedy)
    pooled = [
        engine.add_request(None, {"prompt_token_ids": p}, PoolingParams(task="encode"))
        for p in PROMPTS
    ]
    results = run_until_done(engine)
    assert results[gen.request_id].outputs[0].token_ids == hf_greedy(folder, PROMPTS[1], 8)
    for state, prompt in zip(pooled, PROMPTS, strict=True):
        got, ref = results[state.request_id].outputs.data, hf_pooled(folder, prompt, "MEAN")
        assert cosine(got, ref) > 0.9999
        np.testing.assert_allclose(got, ref, atol=1e-4)
