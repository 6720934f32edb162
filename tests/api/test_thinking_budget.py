"""Reasoning models in the engine, end to end on a tiny random model: a thinking budget
of N gives exactly N thinking tokens (the model's own, unconstrained) and then the
forced end marker; a JSON-schema constraint applies to the answer after the marker only;
ANSWER bounds change nothing; an OPTIONAL start is the model's choice on its first token;
all of it holds under forced preemption (recompute and swap).
The markers are ordinary tokens of the tiny tokenizer ("</think>" is several of them)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagestream import LLM, SamplingParams
from services.common.reasoning_bounds import ReasoningBounds, ReasoningMode
from tests.helpers.parallel import set_preemption_mode
from tests.helpers.structured_constraints import SCHEMA

LLM_ARGS = {"dtype": "float32", "kv_cache_memory": "16MiB"}  # for tests/conftest.py's llm
PROMPT = "The answer is"
JSON = {"json": SCHEMA, "disable_any_whitespace": True}


def _ids(llm: LLM, text: str) -> tuple[int, ...]:
    return tuple(llm.get_tokenizer().encode(text, add_special_tokens=False))


def _bounds(llm: LLM, mode=ReasoningMode.THINKING, start: tuple[int, ...] = ()):
    end = _ids(llm, "</think>")
    return ReasoningBounds(mode, start or _ids(llm, "<think>"), end, end + _ids(llm, "\n"))


def _greedy(llm: LLM, max_tokens: int, **params) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return list(llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids)


def _contains(tokens: list[int], marker: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(marker)]) == marker for i in range(len(tokens)))


@pytest.mark.parametrize("budget", [0, 3, 9])
def test_a_budget_of_n_gives_n_thinking_tokens_then_the_forced_end(llm, budget):
    bounds = _bounds(llm)
    assert len(bounds.end_token_ids) > 1  # the end is detected across several tokens
    free = _greedy(llm, budget + 6)
    assert not _contains(free, bounds.end_token_ids)  # the model never ends it alone
    forced = list(bounds.forced_end_token_ids)
    out = _greedy(llm, budget + len(forced) + 6, reasoning=bounds, thinking_token_budget=budget)
    assert out[:budget] == free[:budget]  # the thinking is the model's own
    assert out[budget : budget + len(forced)] == forced
    assert len(out) == budget + len(forced) + 6  # then the answer goes on


def test_a_json_schema_applies_to_the_answer_after_the_forced_end(llm):
    bounds = _bounds(llm)
    budget, forced = 5, list(bounds.forced_end_token_ids)
    free = _greedy(llm, budget)
    params = SamplingParams(
        temperature=0,
        max_tokens=120,
        structured_outputs=JSON,
        reasoning=bounds,
        thinking_token_budget=budget,
    )
    output = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    tokens = list(output.token_ids)
    assert tokens[:budget] == free  # unconstrained thinking: what the model says alone
    assert not _valid_json_start(llm, free)  # ... which the schema would have refused
    assert tokens[budget : budget + len(forced)] == forced
    answer = llm.get_tokenizer().decode(tokens[budget + len(forced) :])
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert output.finish_reason == "stop"


def _valid_json_start(llm: LLM, tokens: list[int]) -> bool:
    return llm.get_tokenizer().decode(tokens).lstrip().startswith("{")


def test_answer_bounds_leave_a_constrained_request_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=120, structured_outputs=JSON)
    bounds = _bounds(llm, ReasoningMode.ANSWER)
    with_bounds = plain.clone(reasoning=bounds, thinking_token_budget=2)
    outs = llm.generate([PROMPT, PROMPT], [plain, with_bounds], use_tqdm=False)
    first, second = (o.outputs[0] for o in outs)
    assert first.token_ids == second.token_ids and first.finish_reason == "stop"
    jsonschema.validate(json.loads(second.text), SCHEMA)


def test_optional_thinks_only_when_the_first_token_is_the_start(llm):
    start = _ids(llm, "Q")
    assert len(start) == 1
    bounds = _bounds(llm, ReasoningMode.OPTIONAL, start)
    forced = list(bounds.forced_end_token_ids)
    base = SamplingParams(temperature=0, max_tokens=120, structured_outputs=JSON, reasoning=bounds)
    # The start is allowed beside the grammar on the first token only: pushed up, the
    # model opens the thinking with it (and thinks on, pushed, until the budget).
    pushed = base.clone(logit_bias={start[0]: 100.0}, thinking_token_budget=2)
    # Pushed down, it answers at once, exactly as without bounds.
    declined = base.clone(logit_bias={start[0]: -100.0})
    plain = declined.clone(reasoning=None)
    outs = llm.generate([PROMPT] * 3, [pushed, declined, plain], use_tqdm=False)
    thought, answered, reference = (list(o.outputs[0].token_ids) for o in outs)
    assert thought[:3] == [start[0]] * 3  # the start, then two thinking tokens
    assert thought[3 : 3 + len(forced)] == forced
    answer = llm.get_tokenizer().decode(thought[3 + len(forced) :])
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert answered == reference


def test_n_2_sequences_each_think_within_the_budget(llm):
    bounds = _bounds(llm)
    forced = list(bounds.forced_end_token_ids)
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=12,
        ignore_eos=True,
        reasoning=bounds,
        thinking_token_budget=4,
    )
    outputs = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
    assert len(outputs) == 2
    for output in outputs:
        assert list(output.token_ids[4 : 4 + len(forced)]) == forced
    assert outputs[0].token_ids[:4] != outputs[1].token_ids[:4]  # sampled apart


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_thinking_and_its_forced_end_survive_forced_preemption(model_dir, mode):
    llm = LLM(
        str(model_dir("llama")),
        dtype="float32",
        block_size=4,
        kv_cache_memory=24576,  # 12 blocks of 4 tokens for 8 growing requests
        swap_space=0.01,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    set_preemption_mode(llm, mode)
    bounds = _bounds(llm)
    forced = list(bounds.forced_end_token_ids)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=24,
            ignore_eos=True,
            reasoning=bounds,
            thinking_token_budget=3 + i % 3,
            structured_outputs={"regex": "[a-d]+"} if i % 2 else None,
        )
        for i in range(8)
    ]
    results = llm.generate(["Hello there, friend"] * len(params), params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for param, result in zip(params, results, strict=True):
        tokens, budget = list(result.outputs[0].token_ids), param.thinking_token_budget
        assert tokens[budget : budget + len(forced)] == forced, (budget, tokens)
        if param.structured_outputs is not None:
            answer = llm.get_tokenizer().decode(
                tokens[budget + len(forced) :], skip_special_tokens=True
            )
            assert re.fullmatch("[a-d]+", answer), answer
    assert llm.engine.scheduler.kv.num_free_blocks == 12


def test_bounds_outside_the_vocabulary_are_refused_naming_the_field(llm):
    bounds = ReasoningBounds(ReasoningMode.THINKING, (), (99_999,), (99_999,))
    params = SamplingParams(reasoning=bounds, thinking_token_budget=1)
    with pytest.raises(ValueError, match=r"reasoning.end_token_ids contains token id 99999"):
        llm.generate(PROMPT, params, use_tqdm=False)


def test_a_budget_without_the_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match=r"thinking_token_budget needs .*--reasoning-parser"):
        SamplingParams(thinking_token_budget=8)
