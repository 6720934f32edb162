"""A stop string found inside an output of several tokens (a speculative step's accepted
run) ends the sequence at the token that completed it: its token ids, logprobs and
cumulative logprob are those the same tokens give one at a time, as without speculation."""

from __future__ import annotations

import pytest

from services.common.engine_output import EngineCoreOutput
from services.common.runner_output import TokenLogprobs
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.request_state import RequestState
from tests.helpers.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _logprobs(ids):
    return [TokenLogprobs([t], [-0.25 * (i + 1)], [1]) for i, t in enumerate(ids)]


def _run(tokenizer, params, chunks):
    """Feed the token ids in `chunks` (one engine output each, with a logprob per token);
    the final output and the id the frontend asked to abort, if any."""
    state = RequestState("r", "p", [1, 5], params, tokenizer)
    logprobs = _logprobs([t for chunk in chunks for t in chunk])
    aborted, start = None, 0
    for chunk in chunks:
        entries = logprobs[start : start + len(chunk)]
        start += len(chunk)
        aborted = aborted or state.process(EngineCoreOutput("r", chunk, new_logprobs=entries))
        if state.finished:
            break
    return state.make_output().outputs[0], aborted


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_a_run_cuts_the_token_ids_there(tokenizer, include):
    ids = _ids(tokenizer, "The quick brown fox jumps over the lazy dog.")
    params = SamplingParams(stop=["brown"], logprobs=0, include_stop_str_in_output=include)
    one_by_one, aborted_one = _run(tokenizer, params, [[t] for t in ids])
    in_runs, aborted_run = _run(tokenizer, params, [ids[:2], ids[2:7], ids[7:]])
    assert one_by_one.finish_reason == in_runs.finish_reason == "stop"
    assert one_by_one.stop_reason == in_runs.stop_reason == "brown"
    assert in_runs.text == one_by_one.text == ("The quick brown" if include else "The quick ")
    assert in_runs.token_ids == one_by_one.token_ids
    assert len(in_runs.token_ids) < 7  # it stopped inside the run of 5
    assert len(in_runs.logprobs) == len(in_runs.token_ids)
    assert in_runs.cumulative_logprob == pytest.approx(one_by_one.cumulative_logprob)
    assert aborted_one == aborted_run == "r"


def test_delta_outputs_end_at_the_stop_too(tokenizer):
    ids = _ids(tokenizer, "Paged attention stores keys and values in fixed-size blocks.")
    params = SamplingParams(stop=["keys"], output_kind=RequestOutputKind.DELTA)
    state = RequestState("r", "p", [1, 5], params, tokenizer)
    tokens, text = [], ""
    for chunk in (ids[:1], ids[1:6], ids[6:]):
        state.process(EngineCoreOutput("r", chunk))
        out = state.make_output()
        if out is not None:
            tokens += out.outputs[0].token_ids
            text += out.outputs[0].text
        if state.finished:
            break
    assert text == "Paged attention stores "
    assert tokenizer.decode(tokens).startswith("Paged attention stores keys")
    assert not tokenizer.decode(tokens[:-1]).startswith("Paged attention stores keys")
