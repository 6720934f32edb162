"""The merge rule: a request's value > the model's default > vLLM's default."""

import pytest

from services.common.sampling_defaults import sampling_params_with_defaults
from services.common.sampling_params import SamplingParams

MODEL = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 6}


def test_set_fields_win_and_unset_ones_take_the_model_defaults_else_vllms():
    params = sampling_params_with_defaults({"temperature": 0.0, "top_k": 5}, MODEL)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, 5, 0.9, 6)
    assert params.min_p == SamplingParams().min_p


def test_without_model_defaults_vllms_apply():
    assert sampling_params_with_defaults({}, None) == SamplingParams()
    assert sampling_params_with_defaults({}, MODEL) == SamplingParams(**MODEL)


def test_a_bad_value_raises_as_sampling_params_does():
    with pytest.raises(ValueError, match="top_p"):
        sampling_params_with_defaults({"top_p": 7.0}, MODEL)
