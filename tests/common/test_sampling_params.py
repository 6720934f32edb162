import pytest

from services.common.sampling_params import BeamSearchParams, SamplingParams, SamplingType


def test_defaults_match_vllm():
    params = SamplingParams()
    assert params.n == 1 and params.temperature == 1.0 and params.top_p == 1.0
    assert params.top_k == 0 and params.min_p == 0.0 and params.max_tokens == 16
    assert params.repetition_penalty == 1.0 and params.stop == [] and params.stop_token_ids == []
    assert params.skip_special_tokens and not params.include_stop_str_in_output
    assert params.sampling_type == SamplingType.RANDOM


def test_normalisation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"seed": "x"}, "seed"),
        ({"n": 2, "temperature": 0}, "n must be 1"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"length_penalty": float("inf"), "use_beam_search": True}, "length_penalty"),
        ({"length_penalty": float("nan"), "use_beam_search": True}, "length_penalty"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_range_in_message():
    with pytest.raises(ValueError, match=r"\[0.0, 2.0\]"):
        SamplingParams(temperature=3)


def test_greedy_n_allowed_for_beam_search():
    assert SamplingParams(n=3, temperature=0, use_beam_search=True).n == 3
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
