"""LoRA on a mixture of experts (a tiny Qwen3-MoE): adapters on the attention's
projections equal PEFT's greedy outputs on the native CPU step and on the torch path; an
adapter on the MLP's projections (which a mixture has once per expert) is refused naming
them."""

from __future__ import annotations

import pytest

from pagestream import LLM, LoRARequest, SamplingParams
from tests.helpers.peft_reference import ATTENTION, PeftReference, save_adapter

ENGINE = dict(dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory="8MiB")
PROMPTS = [[5, 17, 200, 31, 64, 9], [3, 3, 99, 150, 22, 7, 8, 41, 120, 77]]


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("qwen3_moe")


@pytest.fixture(scope="module")
def adapter(folder, tmp_path_factory):
    return save_adapter(folder, tmp_path_factory.mktemp("moe-lora"), r=8, target_modules=ATTENTION)


@pytest.mark.parametrize("native", [True, False])
def test_attention_adapter_equals_peft(folder, adapter, native):
    llm = LLM(str(folder), enforce_eager=not native, **ENGINE)
    assert (llm.engine.worker.model.model.native is not None) == native
    lora = LoRARequest("attn", 1, str(adapter))
    params = SamplingParams(temperature=0, max_tokens=8)
    peft = PeftReference(folder)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, False, lora)
    base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, False)
    for prompt, out, plain in zip(PROMPTS, outputs, base, strict=True):
        got = list(out.outputs[0].token_ids)
        peft.assert_greedy(str(adapter), prompt, got, 8, what=str(prompt))
        assert got != list(plain.outputs[0].token_ids)  # the adapter changes the output


def test_adapter_on_the_experts_is_refused_by_name(folder, model_dir, tmp_path):
    """An adapter made on a dense model of the same attention (Qwen3) that also targets
    up_proj / down_proj: the mixture has no such single module."""
    dense = save_adapter(
        model_dir("qwen3"), tmp_path / "dense", target_modules=("q_proj", "up_proj")
    )
    llm = LLM(str(folder), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="up_proj"):
        llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}], params, False, LoRARequest("mlp", 2, str(dense))
        )
