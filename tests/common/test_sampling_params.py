import pytest

from services.common.reasoning_bounds import ReasoningBounds, ReasoningMode
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


# ---- reasoning: the thinking's bounds and budget ------------------------------------------
THINK = ReasoningBounds(ReasoningMode.THINKING, (), (9, 10), (4, 9, 10))


def test_a_budget_with_bounds_is_kept_and_a_dict_is_taken_as_bounds():
    params = SamplingParams(
        thinking_token_budget=0,
        reasoning={
            "mode": 2,
            "start_token_ids": [8],
            "end_token_ids": [9],
            "forced_end_token_ids": [9],
        },
    )
    assert params.thinking_token_budget == 0
    assert params.reasoning == ReasoningBounds(ReasoningMode.OPTIONAL, (8,), (9,), (9,))
    assert params.reasoning.mode is ReasoningMode.OPTIONAL


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"thinking_token_budget": 5}, "thinking_token_budget needs .*--reasoning-parser"),
        (
            {"thinking_token_budget": 5, "reasoning": ReasoningBounds(end_token_ids=(9,))},
            "thinking_token_budget needs",
        ),
        ({"thinking_token_budget": -1, "reasoning": THINK}, r"thinking_token_budget must be in"),
        ({"thinking_token_budget": 2**31, "reasoning": THINK}, "thinking_token_budget must be in"),
        ({"thinking_token_budget": 1.5, "reasoning": THINK}, "thinking_token_budget must be an"),
        ({"thinking_token_budget": True, "reasoning": THINK}, "thinking_token_budget must be an"),
        (
            {"thinking_token_budget": 3, "reasoning": THINK, "n": 2, "temperature": 0}
            | {"use_beam_search": True},
            "thinking_token_budget cannot be combined with beam search",
        ),
        ({"reasoning": "think"}, "reasoning must be ReasoningBounds or a dict"),
        ({"reasoning": {"mode": 1, "end": [3]}}, "reasoning: .*end"),
    ],
)
def test_bad_thinking_budgets_are_refused_naming_the_field(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"mode": 7}, "reasoning.mode must be one of ANSWER"),
        ({"mode": ReasoningMode.THINKING}, "reasoning.end_token_ids must not be empty"),
        ({"mode": ReasoningMode.OPTIONAL, "end_token_ids": (3,)}, "start_token_ids must not be"),
        ({"end_token_ids": (1,) * 65}, "reasoning.end_token_ids has 65 token ids; at most 64"),
        ({"forced_end_token_ids": (1, -2)}, "reasoning.forced_end_token_ids must hold token ids"),
        ({"start_token_ids": "<think>"}, "reasoning.start_token_ids must be a list"),
        ({"start_token_ids": (1.0,)}, "reasoning.start_token_ids must hold token ids"),
    ],
)
def test_bad_reasoning_bounds_are_refused_naming_the_field(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        ReasoningBounds(**kwargs)


def test_reasoning_bounds_check_the_vocabulary_by_field():
    THINK.check_vocab(11)
    with pytest.raises(
        ValueError, match=r"reasoning.end_token_ids contains token id 10.*\[0, 10\)"
    ):
        THINK.check_vocab(10)
