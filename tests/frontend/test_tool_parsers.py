"""Tool-call parsers: whole-text extraction, malformed output, and streaming that
assembles to exactly the whole-text result at any chunk boundaries (one character, many
tokens per delta); the JSON scanner's canonical form; the constraint grammars compile."""

from __future__ import annotations

import json
import random

import pytest
from llguidance import LLMatcher

from services.frontend.tool_parsers import assemble, get_tool_parser
from services.frontend.tool_parsers.json_scanner import JsonError, JsonScanner

HERMES_TWO_CALLS = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
    ' "days": 3, "units": ["c", null, true, 1.5e2], "note": "caf\\u00e9 \\"x\\"\\n\\ud83d\\ude00"}}'
    "\n</tool_call>\n"
    '<tool_call>{"arguments":{},"name":"get_time"}</tool_call>'
)


def _summary(result):
    return result.content, [(c.name, c.arguments) for c in result.tool_calls]


def _streamed(parser, text: str, sizes):
    stream, deltas, i = parser.stream(), [], 0
    for size in sizes:
        if i >= len(text):
            break
        deltas.append(stream.feed(text[i : i + size]))
        i += size
    deltas.append(stream.feed(text[i:]))
    deltas.append(stream.finish())
    return deltas


def test_hermes_extracts_content_and_several_calls():
    result = get_tool_parser("hermes")().extract(HERMES_TWO_CALLS)
    assert result.content == "Let me check.\n"
    (first, second) = result.tool_calls
    assert first.name == "get_weather" and second.name == "get_time"
    assert json.loads(first.arguments) == {
        "city": "Paris",
        "days": 3,
        "units": ["c", None, True, 150.0],
        "note": 'café "x"\n😀',
    }
    assert first.arguments.startswith('{"city": "Paris", "days": 3')  # canonical separators
    assert second.arguments == "{}"
    assert first.id.startswith("call_") and first.id != second.id


def test_hermes_only_calls_has_no_content():
    text = '  \n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert _summary(get_tool_parser("hermes")().extract(text)) == (None, [("f", '{"a": 1}')])


@pytest.mark.parametrize(
    "text",
    [
        'Sure <tool_call>\n{"name": oops}\n</tool_call>',
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        "plain text, no calls <tool_",
    ],
)
def test_hermes_malformed_call_before_its_name_is_plain_content(text):
    assert _summary(get_tool_parser("hermes")().extract(text)) == (text, [])


def test_hermes_call_cut_short_keeps_what_was_read():
    text = '<tool_call>{"name": "f", "arguments": {"q": "abc'
    assert _summary(get_tool_parser("hermes")().extract(text)) == (None, [("f", '{"q": "abc')])


def test_parallel_off_keeps_the_first_call():
    result = get_tool_parser("hermes")(max_calls=1).extract(HERMES_TWO_CALLS)
    assert [c.name for c in result.tool_calls] == ["get_weather"]


LLAMA3 = '<|python_tag|>{"name": "f", "parameters": {"a": [1, {"b": "x"}]}}; {"name": "g"}'


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", HERMES_TWO_CALLS),
        ("hermes", 'Sure <tool_call>\n{"name": oops}\n</tool_call>'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "abc'),
        ("hermes", "no calls at all, just text with < and <tool"),
        ("llama3_json", LLAMA3),
        ("llama3_json", "Hello {not a call}"),
    ],
)
def test_streamed_deltas_assemble_to_the_whole_text_result(name, text):
    parser = get_tool_parser(name)()
    whole = _summary(parser.extract(text))
    rng = random.Random(1234)
    chunkings = [[1] * len(text), [len(text)]]  # one character per delta, everything at once
    chunkings += [[rng.randint(1, 24) for _ in range(len(text))] for _ in range(300)]
    for sizes in chunkings:
        deltas = _streamed(parser, text, sizes)
        assert _summary(assemble(deltas)) == whole, sizes
        firsts = [p for d in deltas for p in d.tool_calls if p.id is not None]
        assert [p.index for p in firsts] == list(range(len(whole[1])))  # one header per call
        assert all(p.name and p.arguments == "" for p in firsts)


def test_llama3_json_calls():
    result = get_tool_parser("llama3_json")().extract(LLAMA3)
    assert _summary(result) == (None, [("f", '{"a": [1, {"b": "x"}]}'), ("g", "{}")])


@pytest.mark.parametrize("bad", ['{"a":01}', '{"a" 1}', "[1,]", '{"a":tru}', "{,}", '"\x01"'])
def test_json_scanner_refuses_invalid_json(bad):
    scanner = JsonScanner()
    with pytest.raises(JsonError):
        for char in bad:
            scanner.feed(char)
        scanner.finish()
        assert scanner.done


def test_json_scanner_reports_members_in_canonical_output():
    scanner = JsonScanner()
    for char in '{ "name" :"f" ,\n "arguments":{"x" : [ 1,2 ]} }':
        scanner.feed(char)
    assert scanner.done and scanner.out == '{"name": "f", "arguments": {"x": [1, 2]}}'
    start, end = scanner.members["arguments"]
    assert scanner.out[start:end] == '{"x": [1, 2]}'


TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/city"}},
            "required": ["city"],
            "$defs": {"city": {"enum": ["Paris", "Rome"]}},
        },
    },
    {"name": "get_time"},
]


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
@pytest.mark.parametrize("parallel", [True, False])
def test_constraint_grammars_compile(name, parallel):
    grammar = get_tool_parser(name)().constraint_grammar(TOOLS, parallel)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        LLMatcher.grammar_from_lark(grammar)
    )
    assert not is_error, messages
