"""Sampling values at the edges of their allowed ranges still give tokens, never a crash."""

import pytest

from pagestream import SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 33, 99, 250, 12, 8, 41]}


LLM_ARGS = {"kv_cache_memory": "8MiB", "block_size": 4}  # for tests/conftest.py's llm


@pytest.mark.parametrize(
    "kwargs",
    [
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 1e300},
        {"repetition_penalty": 1e-300, "temperature": 0.0},
        {"temperature": 1e-3, "top_p": 1e-9},
        {"temperature": 2.0, "min_p": 1.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0, "logit_bias": {7: 100.0}},
        {"logit_bias": dict.fromkeys(range(512), -100.0)},
    ],
)
def test_extreme_values_sample(llm, kwargs):
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=1, **kwargs)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    tokens = output.outputs[0].token_ids
    assert len(tokens) == 6
    assert all(0 <= t < 512 for t in tokens)
