"""The default model (SmolLM2-135M: 9 query heads, 3 KV heads) split over three tensor
parallel ranks gives the greedy outputs of one worker; two ranks are refused at start,
with a message that says why, before any worker process starts."""

import pytest

from pagestream import LLM, SamplingParams
from services.worker.models.gguf_weights import dequantized_folder
from tests.helpers.parallel import assert_same_or_near_tie

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "List three prime numbers."]
ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64)


def _chat_ids(llm, question: str) -> list[int]:
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_tp3_matches_one_worker():
    params = SamplingParams(temperature=0, max_tokens=12)
    tp1 = LLM(**ENGINE)
    prompts = [_chat_ids(tp1, q) for q in QUESTIONS]
    expected = [o.outputs[0].token_ids for o in tp1.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )]  # fmt: skip
    tp3 = LLM(tensor_parallel_size=3, **ENGINE)
    try:
        assert tp3.engine.model_info.num_kv_heads == 1  # 3 KV heads, one per rank
        outputs = tp3.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        tp3.engine.close()
    folder = dequantized_folder("smollm2-135m-instruct")
    for prompt, out, ref in zip(prompts, outputs, expected, strict=True):
        assert_same_or_near_tie(folder, prompt, out.outputs[0].token_ids, ref)


def test_tp2_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 .* 9 attention heads"):
        LLM(tensor_parallel_size=2, **ENGINE)
