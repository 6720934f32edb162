"""Structured outputs end to end on a tiny random model: whatever the model wants (here a
logit_bias of +100 on tokens the constraint forbids), every output satisfies its JSON
schema, regex, choice or grammar; over many seeds, n > 1, streaming, and under forced
preemption in both modes. Unconstrained requests in the same batches are unchanged, and
bad constraints are refused naming the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagestream import LLM, SamplingParams
from pagestream.async_engine import AsyncEngine
from tests.helpers.parallel import set_preemption_mode
from tests.helpers.structured_constraints import REGEX, SCHEMA

CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'start: "(" item ("," item)* ")"\nitem: "x" | "yy" | "zzz"'
# Bounded constraints, so every output completes within MAX_TOKENS.
CONSTRAINTS = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "json_object": {"json_object": True, "disable_any_whitespace": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR},
}
MAX_TOKENS = 120
PROMPTS = ["The answer is", "Hello", "def main():", "naïve café"]


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\((x|yy|zzz)(,(x|yy|zzz))*\)", text) is not None


def _forbidding_bias(llm: LLM) -> dict[int, float]:
    """+100 on tokens no constraint here can start with or mostly continue with: letters
    and punctuation that the schema, regex, choices and grammar mostly reject."""
    tokenizer = llm.get_tokenizer()
    ids = set()
    for text in ["}", "]", "Q", "!", "zz", " the", "\n\n", "fox", "42"]:
        ids.update(tokenizer.encode(text, add_special_tokens=False))
    return dict.fromkeys(sorted(ids), 100.0)


LLM_ARGS = {"dtype": "float32", "kv_cache_memory": "16MiB"}  # for tests/conftest.py's llm


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_output_is_valid_over_many_seeds_with_n_2(llm, kind):
    bias = _forbidding_bias(llm)
    params = [
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
            logit_bias=bias,
            structured_outputs=CONSTRAINTS[kind],
        )
        for seed in range(6)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    results = llm.generate(prompts, params, use_tqdm=False)
    texts = [o.text for r in results for o in r.outputs]
    assert len(texts) == 12
    for result in results:
        for output in result.outputs:
            assert output.finish_reason == "stop", (kind, output.text, output.finish_reason)
            assert _valid(kind, output.text), (kind, output.text)
    if kind != "json_object":  # (there the +100 on "}" rightly makes every output "{}")
        assert len(set(texts)) > 1  # sampled, not one forced output


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constraints_hold_under_forced_preemption(model_dir, mode):
    llm = LLM(
        str(model_dir("llama")),
        dtype="float32",
        block_size=4,
        kv_cache_memory=24576,  # 12 blocks of 4 tokens for 10 growing requests
        swap_space=0.01,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    set_preemption_mode(llm, mode)
    kinds = ["regex", "choice", "grammar", "json_object", "regex"] * 2
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs=CONSTRAINTS[kind])
        for i, kind in enumerate(kinds)
    ]
    results = llm.generate(["Hello there, friend"] * len(kinds), params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for kind, result in zip(kinds, results, strict=True):
        output = result.outputs[0]
        if output.finish_reason == "stop":
            assert _valid(kind, output.text), (kind, output.text)
        else:  # only json_object can run long; what it wrote is still a JSON prefix
            assert kind == "json_object" and output.text.startswith("{"), output.text
    assert llm.engine.scheduler.kv.num_free_blocks == 12


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS, greedy, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=c)
        for i, c in enumerate(CONSTRAINTS.values())
    ]
    mixed = llm.generate(
        PROMPTS + PROMPTS[:1] * len(constrained),
        [greedy] * len(PROMPTS) + constrained,
        use_tqdm=False,
    )
    assert [r.outputs[0].token_ids for r in mixed[: len(PROMPTS)]] == [
        r.outputs[0].token_ids for r in alone
    ]


async def test_streaming_deltas_assemble_to_a_valid_output(model_dir):
    engine = AsyncEngine.from_args(
        str(model_dir("llama")), engine_core_process=False, dtype="float32", kv_cache_memory="8MiB"
    )
    try:
        from services.common.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=1.0,
            seed=5,
            max_tokens=MAX_TOKENS,
            structured_outputs=CONSTRAINTS["json"],
            output_kind=RequestOutputKind.DELTA,
        )
        pieces, finish = [], None
        async for out in engine.generate("Hello", params):
            pieces.append(out.outputs[0].text)
            finish = out.outputs[0].finish_reason
        assert finish == "stop" and len(pieces) > 1
        assert _valid("json", "".join(pieces))
    finally:
        await engine.shutdown()


def test_a_grammar_that_allows_only_the_empty_output_ends_at_once(llm):
    params = SamplingParams(temperature=1.0, max_tokens=20, min_tokens=5)
    for constraint in ({"grammar": 'start: ""'}, {"regex": "a{0}"}):
        out = llm.generate("Hi", params.clone(structured_outputs=constraint), use_tqdm=False)
        assert out[0].outputs[0].token_ids == [] and out[0].outputs[0].finish_reason == "stop"


def test_min_tokens_never_makes_a_constrained_row_nan(llm):
    params = SamplingParams(
        temperature=1.0, seed=1, max_tokens=20, min_tokens=10, structured_outputs={"choice": ["a"]}
    )
    out = llm.generate("Hi", params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("a", "stop")


@pytest.mark.parametrize(
    "constraint, problem",
    [
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a[b"}, "unclosed character class"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
        ({"choice": []}, "non-empty list"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ],
)
def test_bad_constraints_are_refused_naming_the_problem(llm, constraint, problem):
    with pytest.raises(ValueError, match=problem):
        llm.generate("Hi", SamplingParams(structured_outputs=constraint), use_tqdm=False)


def test_beam_search_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(n=2, temperature=0, use_beam_search=True, structured_outputs={"regex": "a"})


def test_constraints_hold_with_async_scheduling(model_dir):
    llm = LLM(
        str(model_dir("llama")), dtype="float32", kv_cache_memory="8MiB", async_scheduling=True
    )
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=c)
        for i, c in enumerate([CONSTRAINTS["regex"], CONSTRAINTS["grammar"], CONSTRAINTS["json"]])
    ]
    results = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    for kind, result in zip(["regex", "grammar", "json"], results, strict=True):
        output = result.outputs[0]
        assert output.finish_reason == "stop" and _valid(kind, output.text), output.text


def test_the_python_api_takes_vllms_params_class(llm):
    from pagestream import StructuredOutputsParams

    params = SamplingParams(
        temperature=0.5, seed=3, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    assert llm.generate("Hi", params, use_tqdm=False)[0].outputs[0].text in CHOICES
