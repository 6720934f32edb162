"""The tool-call parser read from a chat template when --tool-call-parser is absent, on
snippets shaped like each family's real template, and the server options built from it."""

from __future__ import annotations

import logging

import pytest

from services.frontend.tool_options import ToolServerOptions
from services.frontend.tool_parsers import detect_tool_parser

QWEN3_CODER = (
    "{%- if tools %}# Tools\n<tools>{% for tool in tools %}<function><name>{{ tool.name }}"
    "</name>{% endfor %}</tools>\nIf you choose to call a function ONLY reply in the following "
    "format:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n</function>\n</tool_call>{%- endif %}"
)
HERMES = (
    "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "{%- endif %}"
)
MISTRAL = (
    "{%- for message in messages %}{%- if message.tool_calls %}[TOOL_CALLS]{%- for call in "
    "message.tool_calls %}{{ call.function.name }}[ARGS]{{ call.function.arguments }}"
    "{%- endfor %}{%- endif %}{%- endfor %}"
)
LLAMA31_JSON = (
    "{%- if tools %}Given the following functions, please respond with a JSON for a function "
    "call with its proper arguments that best answers the given prompt.\n\nRespond in the format"
    ' {"name": function name, "parameters": dictionary of argument name and its value}.'
    "{%- endif %}{%- if builtin_tools %}<|python_tag|>{%- endif %}"
)
LLAMA32_PYTHONIC = (
    "You are an expert in composing functions. If you decide to invoke any of the function(s), "
    "you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2="
    "params_value2...), func_name2(params)]\n{{ tools | tojson }}"
)
LLAMA4_PYTHONIC = "{%- if message.tool_calls %}<|python_start|>[{{ calls }}]<|python_end|>"
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message %}"
    "<|system|>{{ message['content'] }}<|tool|>{{ message['tools'] }}<|/tool|><|end|>"
    "{% endif %}{% endfor %}"
)
GEMMA3 = (
    "{{ bos_token }}{%- for message in messages -%}<start_of_turn>{{ role }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{%- endfor -%}"
)
SMOLLM3 = '{%- if xml_tools %}<tool_call>{"name": ..., "arguments": ...}</tool_call>{% endif %}'


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN3_CODER, "qwen3_coder"),
        (HERMES, "hermes"),
        (SMOLLM3, "hermes"),
        (MISTRAL, "mistral"),
        (LLAMA31_JSON, "llama3_json"),
        (LLAMA32_PYTHONIC, "pythonic"),
        (LLAMA4_PYTHONIC, "pythonic"),
        (PHI4_MINI, "phi4_mini_json"),
        ("functools[{{ tool_calls | tojson }}]", "phi4_mini_json"),
        (GEMMA3, None),
        ("", None),
        (None, None),
    ],
)
def test_detects_each_family(template, expected):
    assert detect_tool_parser(template) == expected


def test_auto_tool_choice_starts_without_a_parser_and_takes_the_detected_one(caplog):
    options = ToolServerOptions(enable_auto_tool_choice=True)
    assert options.tool_call_parser is None
    with caplog.at_level(logging.INFO, logger="services.frontend.tool_options"):
        detected = options.for_template(MISTRAL)
    assert detected.tool_call_parser == "mistral" and detected.enable_auto_tool_choice
    assert "tool-call parser: mistral (detected from the chat template)" in caplog.text
    assert options.tool_call_parser is None  # a copy: the flags stay as given


def test_an_explicit_parser_wins_and_nothing_detected_keeps_none(caplog):
    explicit = ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert explicit.for_template(MISTRAL) is explicit
    with caplog.at_level(logging.INFO, logger="services.frontend.tool_options"):
        plain = ToolServerOptions(enable_auto_tool_choice=True).for_template(GEMMA3)
    assert plain.tool_call_parser is None and "detected" not in caplog.text


def test_an_unknown_parser_name_still_fails_at_start():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        ToolServerOptions(tool_call_parser="nope")
