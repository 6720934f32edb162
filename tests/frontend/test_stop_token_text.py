"""The token that stopped a request (EOS, a stop token id) adds no text, even when special
tokens are shown (tool parsers turn skip_special_tokens off), unless
include_stop_str_in_output asks for it; a grammar that completes on an ordinary token
keeps that token's text."""

import pytest

from services.common.engine_output import EngineCoreOutput
from services.common.sampling_params import SamplingParams
from services.frontend.request_state import RequestState
from tests.helpers.tiny_tokenizer import build_tokenizer

EOS = 2  # "</s>" in the test tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _text(tokenizer, params: SamplingParams, out: EngineCoreOutput) -> str:
    state = RequestState("r", "p", [1, 5], params, tokenizer)
    state.process(out)
    return state.make_output().outputs[0].text


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_shows_only_when_asked(tokenizer, include):
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    ids = [*_ids(tokenizer, "The fox"), EOS]
    text = _text(tokenizer, params, EngineCoreOutput("r", ids, finish_reason="stop"))
    assert text == ("The fox</s>" if include else "The fox")


def test_a_stop_token_id_adds_no_text(tokenizer):
    stop = _ids(tokenizer, "!")[-1]
    params = SamplingParams(stop_token_ids=[stop])
    ids = [*_ids(tokenizer, "The fox"), stop]
    out = EngineCoreOutput("r", ids, finish_reason="stop", stop_reason=stop)
    assert _text(tokenizer, params, out) == "The fox"


def test_a_grammar_that_completes_on_an_ordinary_token_keeps_it(tokenizer):
    ids = _ids(tokenizer, '{"a": 1}')
    out = EngineCoreOutput("r", ids, finish_reason="stop")  # no stop token: the grammar ended
    assert _text(tokenizer, SamplingParams(skip_special_tokens=False), out) == '{"a": 1}'
