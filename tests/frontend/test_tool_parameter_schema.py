"""Tool parameter schemas whose references loop or nest deeply: reading a parameter's
types stops (and stays cheap), the qwen3_coder / pythonic parsers read such calls whole
and streamed, their grammars compile, and a schema a grammar cannot carry is a 400 that
names `tools`, never a crash."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from services.common.structured_outputs import StructuredOutputsParams, check_grammar
from services.frontend.openai.chat_messages import ChatTool
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.tool_choice import plan_tools
from services.frontend.tool_options import ToolServerOptions
from services.frontend.tool_parsers import get_tool_parser, parameter_schema
from tests.frontend.tool_parser_cases import assembled, chunkings, summary


def _rooted(x: dict, defs: dict | None = None) -> dict:
    schema = {"type": "object", "properties": {"x": x}, "required": ["x"]}
    return {**schema, "$defs": defs} if defs is not None else schema


SELF_UNION = _rooted(
    {"$ref": "#/$defs/a"}, {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "integer"}]}}
)
TWO_STEP_CYCLE = _rooted(
    {"$ref": "#/$defs/a"}, {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}
)
TREE = _rooted(
    {"$ref": "#/$defs/node"},
    {
        "node": {
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        }
    },
)
SCHEMAS = {"self_union": SELF_UNION, "two_step_cycle": TWO_STEP_CYCLE, "tree": TREE}
# What each parser reads x as, from the types the schema gives it.
CALLS = {
    "self_union": ("5", 5),
    "two_step_cycle": ("5", 5),  # no type: read as JSON
    "tree": ('{"kids": [{"kids": []}]}', {"kids": [{"kids": []}]}),
}


def _call_text(parser: str, written: str) -> str:
    if parser == "qwen3_coder":
        return f"<tool_call>\n<function=f>\n<parameter=x>\n{written}\n</parameter>\n</function>"
    return f"[f(x={written})]"


@pytest.mark.parametrize(
    ("name", "expected"),
    [("self_union", ["integer"]), ("two_step_cycle", []), ("tree", ["object"])],
)
def test_types_stop_at_a_reference_cycle(name, expected):
    schema = SCHEMAS[name]
    assert parameter_schema.types(schema["properties"]["x"], schema) == expected


def test_types_follow_each_reference_once_however_many_options_repeat_it(monkeypatch):
    options = [{"$ref": "#/$defs/a"}] * 40 + [{"type": "string"}]
    schema = _rooted({"$ref": "#/$defs/a"}, {"a": {"anyOf": options}})
    followed = []
    target = parameter_schema._target

    def counted(ref, parameters):
        followed.append(ref)
        return target(ref, parameters)

    monkeypatch.setattr(parameter_schema, "_target", counted)
    assert parameter_schema.types(schema["properties"]["x"], schema) == ["string"]
    assert followed == ["#/$defs/a"]


def test_types_of_deeply_nested_unions_are_bounded():
    deep = {"type": "integer"}
    for _ in range(5000):
        deep = {"anyOf": [deep]}
    assert parameter_schema.types(deep) == []
    shallow = {"type": "integer"}
    for _ in range(parameter_schema.MAX_NESTING):
        shallow = {"anyOf": [shallow]}
    assert parameter_schema.types(shallow) == ["integer"]


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_parsers_read_calls_of_looping_schemas_whole_and_streamed(parser, name):
    written, value = CALLS[name]
    tools = [{"name": "f", "parameters": SCHEMAS[name]}]
    reader = get_tool_parser(parser)(tools=tools)
    text = _call_text(parser, written)
    whole = summary(reader.extract(text))
    assert [(n, json.loads(a)) for n, a in whole[1]] == [("f", {"x": value})]
    for sizes in chunkings(text, 3):
        assert assembled(reader, text, sizes) == whole


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_grammars_of_looping_schemas_compile(parser, name):
    tools = [{"name": "f", "parameters": SCHEMAS[name]}]
    grammar = get_tool_parser(parser)().constraint_grammar(tools, parallel=False)
    check_grammar(StructuredOutputsParams(grammar=grammar))


def _plan(parser: str, parameters: dict, tool_choice: str):
    tool = ChatTool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": parameters}}
    )
    request = SimpleNamespace(tools=[tool], tool_choice=tool_choice, parallel_tool_calls=None)
    options = ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser=parser)
    return plan_tools(request, options)


@pytest.mark.parametrize("parser", ["qwen3_coder", "pythonic"])
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_looping_schemas_plan_without_error(parser, tool_choice):
    plan = _plan(parser, SELF_UNION, tool_choice)
    (call,) = plan.parser.extract(_call_text(parser, "5")).tool_calls
    assert json.loads(call.arguments) == {"x": 5}


def test_a_reference_a_parameter_grammar_cannot_carry_is_a_400_naming_tools():
    parameters = _rooted({"$ref": "#/properties/y"})
    parameters["properties"]["y"] = {"type": "integer"}
    with pytest.raises(InvalidRequestError) as raised:
        _plan("pythonic", parameters, "required")
    assert raised.value.param == "tools"
    assert "'#/properties/y'" in str(raised.value)
