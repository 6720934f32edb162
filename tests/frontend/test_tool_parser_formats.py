"""Every native tool-call format (hermes, qwen3_coder, mistral's two forms, pythonic with
and without Llama 4's tags, llama3_json, phi4_mini_json): the exact calls of a reply
whole and streamed at any chunk boundaries, content before calls, parallel calls off,
strings with quotes / newlines / non-ASCII, nested objects, and each format's own rules."""

from __future__ import annotations

import json
import re

import pytest

from services.frontend.tool_parsers import get_tool_parser
from tests.frontend.tool_parser_cases import (
    EXPECTED,
    REPLIES,
    TOOLS,
    assembled,
    chunkings,
    parser_name,
    streamed,
    summary,
)


def _parser(case: str, **kwargs):
    return get_tool_parser(parser_name(case))(tools=TOOLS, **kwargs)


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_whole_reply_gives_the_exact_calls(case):
    content, calls = REPLIES[case]
    result = _parser(case).extract(content + calls)
    assert summary(result) == (content or None, EXPECTED)
    assert json.loads(result.tool_calls[0].arguments)["city"] == 'Zürich "HB"\n🙂 \\ end'
    assert len({c.id for c in result.tool_calls}) == 2


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_streamed_reply_assembles_to_the_same_calls(case):
    text = "".join(REPLIES[case])
    parser = _parser(case)
    whole = summary(parser.extract(text))
    for sizes in chunkings(text, 150):
        deltas = streamed(parser, text, sizes)
        headers = [p for d in deltas for p in d.tool_calls if p.id is not None]
        assert [(p.index, p.name, p.arguments) for p in headers] == [
            (0, "get_weather", ""),
            (1, "get_time", ""),
        ]
        assert assembled(parser, text, sizes) == whole, sizes


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_parallel_calls_off_keeps_the_first_call(case):
    content, calls = REPLIES[case]
    result = _parser(case, max_calls=1).extract(content + calls)
    assert summary(result) == (content or None, EXPECTED[:1])


@pytest.mark.parametrize("case", ["qwen3_coder", "pythonic"])
def test_argument_fragments_arrive_before_the_call_ends(case):
    """Formats whose arguments are not JSON still stream them piece by piece."""
    text = "".join(REPLIES[case])
    deltas = streamed(_parser(case), text, [1] * len(text))
    pieces = [p.arguments for d in deltas for p in d.tool_calls if p.index == 0 and p.arguments]
    assert pieces[0].startswith('{"city": ') and len(pieces) >= 4
    assert "".join(pieces) == EXPECTED[0][1]


def test_mistral_ids_are_nine_letters_or_digits():
    text = "".join(REPLIES["mistral"])
    for call in _parser("mistral").extract(text).tool_calls:
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)


def test_mistral_call_id_marker_is_read_and_the_id_replaced():
    text = '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "UTC"}'
    assert summary(_parser("mistral").extract(text)) == (None, [("get_time", '{"tz": "UTC"}')])


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("42", {"type": "integer"}, 42),
        ("4.0", {"type": "integer"}, 4),
        ("2.5", {"type": "number"}, 2.5),
        ("1e999", {"type": "number"}, "1e999"),
        ("TRUE", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, "yes"),
        ("None", {"type": ["string", "null"]}, None),
        ("null", {"type": "string"}, "null"),
        ("007", {"type": "string"}, "007"),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),
        ("[1, 2]", None, [1, 2]),
        ("plain words", None, "plain words"),
        ("3", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 3),
    ],
)
def test_qwen3_coder_values_follow_the_schema_type(value, schema, expected):
    properties = {"x": schema} if schema is not None else {}
    tools = [{"name": "f", "parameters": {"type": "object", "properties": properties}}]
    text = f"<tool_call>\n<function=f>\n<parameter=x>\n{value}\n</parameter>\n</function>"
    (call,) = get_tool_parser("qwen3_coder")(tools=tools).extract(text).tool_calls
    assert json.loads(call.arguments) == {"x": expected}


def test_qwen3_coder_string_keeps_its_inner_newlines_and_markup():
    value = "\n  <div>\n</div>\n\n"
    text = f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{value}\n</parameter>\n"
    text += "</function>\n</tool_call>"
    (call,) = _parser("qwen3_coder").extract(text).tool_calls
    assert json.loads(call.arguments) == {"city": value}


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("qwen3_coder", "Sure <tool_call>\n<junk>\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=a<b>\n</function>"),
        ("qwen3_coder", "text <tool_call"),
        ("mistral", "[TOOL_CALLS]get weather[ARGS]{}"),
        ("mistral", '[TOOL_CALLS][{"nam": "f"}]'),
        ("mistral", "[TOOL_CALLS]f[ARGS]"),
        ("pythonic", "[see(this)]"),
        ("pythonic", "[f(x=__import__('os').system('true'))]"),
        ("pythonic", "[f(1, 2)]"),
        ("pythonic", "[f(x={1, 2})]"),
        ("pythonic", "[f(x=1e999)]"),
        ("pythonic", "Here: [f(x=1)]"),
        ("phi4_mini_json", "functools[not json]"),
    ],
)
def test_malformed_markup_before_a_call_is_content(name, text):
    assert summary(get_tool_parser(name)(tools=TOOLS).extract(text)) == (text, [])


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=q>\nab", [("f", '{"q": "ab')]),
        ("pythonic", "[f(x=1), g(y=", [("f", '{"x": 1}')]),
        ("pythonic", "[f(x=1, y=os.getcwd())]", [("f", '{"x": 1')]),
        (
            "mistral",
            '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{"b',
            [("f", '{"a": 1}'), ("g", '{"b')],
        ),
    ],
)
def test_cut_short_or_broken_after_a_call_keeps_what_was_sent(name, text, expected):
    q_tools = [{"name": "f", "parameters": {"properties": {"q": {"type": "string"}}}}]
    assert summary(get_tool_parser(name)(tools=q_tools).extract(text)) == (None, expected)


def test_unknown_function_names_are_still_calls():
    text = "[no_such_tool(a=1)]"
    assert summary(_parser("pythonic").extract(text)) == (None, [("no_such_tool", '{"a": 1}')])


def test_text_after_the_calls_is_dropped():
    text = "".join(REPLIES["phi4_mini_json"]) + " and some more"
    assert summary(_parser("phi4_mini_json").extract(text))[1] == EXPECTED
