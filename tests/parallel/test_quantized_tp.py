"""Quantized shards under tensor parallelism: a tiny Llama as a Q4_1 GGUF file (every matrix,
the tied embedding included) at tp = 2 (two mp worker processes over gloo) gives the greedy
outputs of tp = 1 on the same file and of tp = 1 on its de-quantized float checkpoint (a
divergence only where HF transformers' top two logits on those weights tie).
Column-parallel layers take whole quantized rows, row-parallel ones whole groups of 32
input features, the vocabulary shards its quantized rows (zero-padded).

A tiny Qwen3 Q8_0 file (q/k norms replicated on both ranks, head_dim 32 with 4 heads on a
hidden size of 64) and a tiny Gemma 3 one (its output norms after the all-reduce) do the
same.

One worker group per file for the whole module (process groups take seconds to start)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from pagestream import LLM
from services.common.model_source import resolve_model
from tests.helpers.model_cache import isolated_model_cache
from tests.helpers.parallel import (
    assert_same_or_near_tie,
    generate_ids,
    greedy_params,
    mixed_prompts,
)
from tests.helpers.tiny_gguf import reference_folder, write_tiny_gguf
from tests.helpers.tiny_models import build_tiny_model

ENGINE = dict(
    dtype="float32", quantization="gguf", kv_cache_memory="4MiB", max_num_batched_tokens=48
)


def _write(root, name: str, matrix_type: str, arch: str, **overrides):
    path = root / f"tiny-{arch}.{matrix_type}.gguf"
    # intermediate 128: each rank's half of down_proj's inputs is two whole groups of 32
    model = build_tiny_model(name, seed=3, vocab_size=300, intermediate_size=128, **overrides)
    expected = write_tiny_gguf(path, model, matrix_type, arch=arch)
    return path, reference_folder(resolve_model(path), expected, root / f"reference-{arch}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-tp")
    cache = pytest.MonkeyPatch()
    isolated_model_cache(root / "cache", cache)
    yield {
        "llama": _write(root, "llama_tied", "Q4_1", "llama"),
        "qwen3": _write(root, "qwen3", "Q8_0", "qwen3"),
        # what a GGUF file can say: 5 sliding layers to 1 full, the scale of head_dim
        "gemma3": _write(
            root,
            "gemma3",
            "Q8_0",
            "gemma3",
            num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            query_pre_attn_scalar=32,
            final_logit_softcapping=None,
        ),
    }
    cache.undo()


@pytest.fixture(scope="module")
def tp2(files):
    llm = LLM(str(files["llama"][0]), tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.engine.close()


def test_tp2_quantized_shards_match_tp1_and_hf(tp2, files):
    path, reference = files["llama"]
    info = tp2.engine.model_info
    assert info.quantization == "Q4_1"
    prompts = mixed_prompts(6, seed=11, vocab=300)
    params = greedy_params(len(prompts), max_tokens=10)
    got = generate_ids(tp2, prompts, params)
    tp1 = LLM(str(path), **ENGINE)
    expected = generate_ids(tp1, prompts, params)
    # the shards hold the rows and groups of the single-rank weights: about half each
    assert (
        tp1.engine.model_info.weight_bytes
        < info.weight_bytes
        < 1.3 * tp1.engine.model_info.weight_bytes
    )
    for prompt, g, e in zip(prompts, got, expected, strict=True):
        assert_same_or_near_tie(reference, prompt, g, e)
    hf = generate_ids(LLM(str(reference), dtype="float32", kv_cache_memory="4MiB"), prompts, params)
    for prompt, g, e in zip(prompts, got, hf, strict=True):
        assert_same_or_near_tie(reference, prompt, g, e)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_tp2_qwen3_and_gemma3_match_hf(arch, files):
    path, reference = files[arch]
    prompts = mixed_prompts(4, seed=12, vocab=300)
    params = greedy_params(len(prompts), max_tokens=8)
    tp2 = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        assert tp2.engine.model_info.quantization == "Q8_0"
        assert tp2.engine.model_info.tensor_parallel_size == 2
        got = generate_ids(tp2, prompts, params)
    finally:
        tp2.engine.close()
    expected_class = {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[arch]
    assert AutoConfig.from_pretrained(reference).architectures == [expected_class]
    hf = generate_ids(LLM(str(reference), dtype="float32", kv_cache_memory="4MiB"), prompts, params)
    for prompt, g, e in zip(prompts, got, hf, strict=True):
        assert_same_or_near_tie(reference, prompt, g, e)
