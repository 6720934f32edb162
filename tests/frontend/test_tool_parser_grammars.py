"""The `required` / named-function grammar of every format: it compiles, llguidance lets a
model write a valid call in the format (which the parser then reads back exactly) and
stops a malformed one or one whose arguments break the tool's schema."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from services.common.structured_outputs import StructuredOutputsParams, check_grammar
from services.frontend.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.frontend.tool_parser_cases import TOOLS, summary
from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

CITY = 'Zürich "HB" </para'
ARGS = {"city": CITY, "days": 3, "units": "f", "options": {"hourly": False}}
ARGS_JSON = json.dumps(ARGS, ensure_ascii=False)

# What a model writes under each grammar (one call of get_weather, one of get_time).
VALID = {
    "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS_JSON}}}\n</tool_call>'
    '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": f'{{"name": "get_weather", "parameters": {ARGS_JSON}}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": f"[TOOL_CALLS]get_weather[ARGS]{ARGS_JSON}[TOOL_CALLS]get_time[ARGS]{{}}",
    "phi4_mini_json": f'functools[{{"name": "get_weather", "arguments": {ARGS_JSON}}}, '
    '{"name": "get_time", "arguments": {}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    f"{CITY}\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=units>\nf\n"
    '</parameter>\n<parameter=options>\n{"hourly": false}\n</parameter>\n</function>\n'
    "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    "pythonic": f'[get_weather(city={json.dumps(CITY, ensure_ascii=False)}, days=3, units="f",'
    ' options={"hourly": false}), get_time()]',
}
# Each breaks the format or the schema (days must be an integer, units c or f).
INVALID = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": 1}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"days": 3}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "x", "units": "k"}',
    "phi4_mini_json": 'functools[{"name": "nope", "arguments": {}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n</parameter>\n"
    "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
    "pythonic": '[get_weather(city="x", days="3")]',
}
SECOND_FORM = {  # mistral's older form is admitted too
    "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS_JSON}}}]',
}


@pytest.fixture(scope="module")
def tokenizer():
    hf = build_tokenizer()
    ll = LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=VOCAB, eos_token=[2])
    return hf, ll


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    hf, ll = tokenizer
    matcher = LLMatcher(ll, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = hf.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


def test_every_parser_has_a_valid_and_an_invalid_sample():
    assert set(VALID) == set(INVALID) == set(TOOL_PARSERS)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("parallel", [True, False])
def test_grammar_compiles(name, parallel):
    grammar = get_tool_parser(name)().constraint_grammar(TOOLS, parallel)
    check_grammar(StructuredOutputsParams(grammar=grammar))


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_grammar_admits_its_format_and_the_parser_reads_it_back(name, tokenizer):
    parser = get_tool_parser(name)(tools=TOOLS)
    grammar = parser.constraint_grammar(TOOLS, parallel=True)
    assert _accepts(tokenizer, grammar, VALID[name])
    content, calls = summary(parser.extract(VALID[name]))
    assert content is None
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", ARGS), ("get_time", {})]
    if name in SECOND_FORM:
        assert _accepts(tokenizer, grammar, SECOND_FORM[name])


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_grammar_refuses_malformed_or_schema_breaking_calls(name, tokenizer):
    grammar = get_tool_parser(name)().constraint_grammar(TOOLS, parallel=True)
    assert not _accepts(tokenizer, grammar, INVALID[name])
    assert not _accepts(tokenizer, grammar, "Sure! " + VALID[name])


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_parallel_off_admits_one_call_only(name, tokenizer):
    grammar = get_tool_parser(name)().constraint_grammar(TOOLS, parallel=False)
    assert not _accepts(tokenizer, grammar, VALID[name])


@pytest.mark.parametrize("name", ["qwen3_coder", "pythonic"])
def test_optional_parameters_may_be_left_out(name, tokenizer):
    grammar = get_tool_parser(name)().constraint_grammar(TOOLS[:1], parallel=False)
    text = {
        "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nx\n"
        "</parameter>\n<parameter=units>\nc\n</parameter>\n</function>\n</tool_call>",
        "pythonic": '[get_weather(city="x", units="c")]',
    }[name]
    assert _accepts(tokenizer, grammar, text)
    missing_city = text.replace("<parameter=city>\nx\n</parameter>\n", "").replace('city="x", ', "")
    assert not _accepts(tokenizer, grammar, missing_city)


def test_pythonic_booleans_are_python_literals(tokenizer):
    tools = [{"name": "f", "parameters": {"properties": {"on": {"type": "boolean"}}}}]
    grammar = get_tool_parser("pythonic")().constraint_grammar(tools, parallel=False)
    assert _accepts(tokenizer, grammar, "[f(on=True)]")
    assert not _accepts(tokenizer, grammar, "[f(on=true)]")
