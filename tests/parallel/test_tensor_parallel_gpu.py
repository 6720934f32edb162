"""tp = 2 over NCCL on two CUDA devices gives the greedy outputs of one device (float32, a
tiny Llama). Skipped, and says so, without two CUDA devices; scripts/gpu_check.sh runs it."""

import pytest
import torch

from pagestream import LLM
from tests.helpers.parallel import (
    assert_same_or_near_tie,
    generate_ids,
    greedy_params,
    mixed_prompts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices (tp = 2 over NCCL)",
    ),
]

ENGINE = dict(device="cuda", dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64)


def test_tp2_over_nccl_matches_one_device(model_dir):
    folder = model_dir("llama")
    prompts = [p[:30] for p in mixed_prompts(8, seed=9)]
    params = greedy_params(len(prompts), max_tokens=8)
    expected = generate_ids(LLM(str(folder), **ENGINE), prompts, params)
    tp2 = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    try:
        got = generate_ids(tp2, prompts, params)
    finally:
        tp2.engine.close()
    for prompt, out, ref in zip(prompts, got, expected, strict=True):
        assert_same_or_near_tie(folder, prompt, out, ref)
