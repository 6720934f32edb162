"""Pooling across the process boundaries serve uses: the engine core in a child process
(engine.proto carries the pooled vector) over a worker in a process of its own
(worker.proto carries the final vector of the step that ends the prompt); the results
equal HF AutoModel's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
import torch

from pagestream import AsyncEngine, PoolingParams, SamplingParams
from tests.helpers.hf_pooling import cosine, hf_pooled, normalized

module_loop = pytest.mark.asyncio(loop_scope="module")
PROMPTS = [
    [5, 17, 33, 99, 250, 12, 8, 41, 7, 9, 11, 13, 15, 17, 19, 21, 23],
    [4, 8, 15, 16, 23, 42],
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir):
    engine = await asyncio.to_thread(
        AsyncEngine.from_args,
        str(model_dir("llama")),
        runner="pooling",
        pooler_config={"pooling_type": "MEAN"},
        dtype="float32",
        kv_cache_memory="8MiB",
        max_num_batched_tokens=8,
        distributed_executor_backend="mp",
    )
    yield engine
    await engine.shutdown()


@module_loop
async def test_embeddings_cross_both_hops(engine, model_dir):
    assert engine.process is not None  # the engine core runs in its own process
    outputs = await asyncio.gather(
        *(engine.encode({"prompt_token_ids": p}, PoolingParams()) for p in PROMPTS),
        engine.encode({"prompt_token_ids": PROMPTS[0]}, PoolingParams(task="encode")),
    )
    for prompt, output in zip(PROMPTS, outputs, strict=False):
        ref = normalized(hf_pooled(model_dir("llama"), prompt, "MEAN"))
        assert cosine(output.outputs.data, ref) > 0.9999
        np.testing.assert_allclose(output.outputs.data, ref, atol=1e-4)
    assert isinstance(outputs[-1].outputs.data, torch.Tensor)
    raw = hf_pooled(model_dir("llama"), PROMPTS[0], "MEAN")
    np.testing.assert_allclose(outputs[-1].outputs.data, raw, atol=1e-4)


@module_loop
async def test_generation_runs_beside_pooling(engine, model_dir, hf_greedy):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def generate():
        final = None
        async for out in engine.generate({"prompt_token_ids": PROMPTS[1]}, greedy):
            final = out
        return final

    gen, pooled = await asyncio.gather(
        generate(), engine.encode({"prompt_token_ids": PROMPTS[0]}, PoolingParams())
    )
    assert gen.outputs[0].token_ids == hf_greedy(model_dir("llama"), PROMPTS[1], 6)
    ref = normalized(hf_pooled(model_dir("llama"), PROMPTS[0], "MEAN"))
    np.testing.assert_allclose(pooled.outputs.data, ref, atol=1e-4)


@module_loop
async def test_bad_pooling_input_is_refused_and_the_engine_serves_on(engine):
    with pytest.raises(ValueError, match="Matryoshka"):
        await engine.encode({"prompt_token_ids": PROMPTS[1]}, PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="empty"):
        await engine.encode({"prompt_token_ids": []})
    out = await engine.encode({"prompt_token_ids": PROMPTS[1]})
    assert out.outputs.data.shape == (64,)
