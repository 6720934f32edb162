"""bfloat16 on the CPU runs mixed precision (bf16 weights and matmul inputs; the residual
stream, norms and the last norm in float32; the LM head's top candidates rescored in
float32): its greedy tokens follow HF transformers in float32, diverging only where the
reference's top two logits are closer than bf16 can tell apart."""

from __future__ import annotations

import torch

from pagestream import LLM, SamplingParams
from services.worker.layers.vocab_embedding import RESCORED_CANDIDATES, rescore_top
from tests.helpers.parallel import mixed_prompts, top2_gap

# bf16 keeps 8 significant bits: every rounding moves a value by up to 2^-9 of itself, and
# the roundings of 2 layers add up on logits that span about +-4 in these tiny models.
# Measured over 32 prompts x 24 tokens: 17 follow HF float32 all the way, the others first
# diverge where the reference's top-2 gap is 0.002-0.042. BF16_TIE (2.5% of the logit
# span) is what bf16 cannot split; a real error (a wrong mask, a missed residual) gives
# divergences at gaps of whole logits.
BF16_TIE = 0.1


def _assert_follows_hf_float32(llm: LLM, folder, prompts: list[list[int]], hf_greedy) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    exact = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        got, expected = out.outputs[0].token_ids, hf_greedy(folder, prompt, 24)
        if got == expected:
            exact += 1
            continue
        k = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        gap = top2_gap(folder, prompt + expected[:k])
        assert gap < BF16_TIE, f"diverges at step {k} where HF float32's top-2 gap is {gap:.3f}"
    assert exact >= len(prompts) // 3  # many follow float32 all the way


def test_bf16_greedy_follows_hf_float32_up_to_bf16_ties(model_dir, hf_greedy):
    folder = model_dir("llama")
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="8MiB")
    _assert_follows_hf_float32(llm, folder, mixed_prompts(8, seed=11), hf_greedy)


def test_a_bfloat16_kv_cache_under_a_float32_model(model_dir, hf_greedy):
    """--kv-cache-dtype bfloat16: keys and values rounded once on the way into the cache
    (half the bytes per block), everything else float32."""
    folder = model_dir("llama")
    llm = LLM(str(folder), dtype="float32", kv_cache_dtype="bfloat16", kv_cache_memory="8MiB")
    full = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")
    cache = llm.engine.worker.runner.cache_engine
    assert cache.dtype == torch.bfloat16
    assert cache.kv_caches[0].dtype == torch.bfloat16
    assert llm.engine.worker.model.dtype == torch.float32
    half, whole = (e.engine.worker.kv_cache_spec.bytes_per_block(16) for e in (llm, full))
    assert 2 * half == whole
    _assert_follows_hf_float32(llm, folder, mixed_prompts(8, seed=12), hf_greedy)


def test_rescoring_gives_the_float32_logits_of_the_top_candidates():
    torch.manual_seed(0)
    hidden = torch.randn(5, 64)
    weight = torch.randn(300, 64).bfloat16()
    exact = hidden @ weight.float().t()  # float32 products of the bf16 weights
    rough = (hidden.bfloat16() @ weight.t()).float()  # what the bf16 matmul gives
    rescored = rescore_top(rough.clone(), hidden, weight)
    top = rough.topk(RESCORED_CANDIDATES, dim=-1).indices
    assert torch.allclose(rescored.gather(1, top), exact.gather(1, top), atol=1e-5)
    assert torch.equal(rescored.argmax(-1), exact.argmax(-1))
    assert (rough - exact).abs().max() > 1e-2  # the rough logits really were off
