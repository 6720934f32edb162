"""Lark grammars (llguidance's dialect) for formats that write each argument on its own
rather than as one JSON object: qwen3_coder's `<parameter=KEY>` blocks and pythonic's
`KEY=value` keywords. A tool's declared properties are written in their declared order,
the required ones always, the others optionally; how each value is constrained:
`_xml_value` and `_python_value`.
"""

from __future__ import annotations

import json

from services.common.structured_outputs import BOUNDED_JSON_WHITESPACE
from services.frontend.tool_parsers import parameter_schema
from services.frontend.tool_parsers.grammar import lark_string
from services.frontend.tool_parsers.markup import MAX_NAME_CHARS

_WHITESPACE = {"whitespace_flexible": True, "whitespace_pattern": BOUNDED_JSON_WHITESPACE}
_STRING_LIMITS = ("pattern", "format", "minLength", "maxLength")

# An XML value and its closing tag as one lexeme: text with no "\n</parameter>" in it, then
# that tag (a lexeme ending at the tag keeps llguidance's greedy lexer from reading past it).
_XML_TERMINALS = [
    'XML_VALUE: XML_TEXT "\\n</parameter>\\n"',
    r"XML_TEXT: /(?s:.*)/ & ~/(?s:.*)\n<\/parameter>(?s:.*)/",
    rf"PARAMETER_NAME: /[^<>\n]{{1,{MAX_NAME_CHARS}}}/",
]


def _json_rule(schema: dict, parameters: dict) -> str:
    """ValueError when the parameter's schema refers to a part of its tool's schema that a
    rule of its own cannot carry (anything but `$defs` / `definitions`)."""
    foreign = parameter_schema.foreign_references(schema)
    if foreign:
        raise ValueError(
            f"a parameter's schema refers to {foreign[0]!r}: this format's grammar writes each "
            "parameter on its own, so a reference must point into $defs or definitions"
        )
    rooted = parameter_schema.with_definitions(schema, parameters)
    return f"%json {json.dumps({**rooted, 'x-guidance': _WHITESPACE})}"


def _tool_parameters(tool: dict) -> dict:
    parameters = tool.get("parameters")
    return parameters if isinstance(parameters, dict) else {}


# ---- qwen3_coder -------------------------------------------------------------------------
def xml_call_grammar(tools: list[dict], parallel: bool) -> str:
    rules = []
    for t, tool in enumerate(tools):
        head = lark_string(f"<function={tool['name']}>\n")
        rules.append(f'fn_{t}: {head} {_xml_parameters(t, tool, rules)} "</function>\\n"')
    alternatives = " | ".join(f"fn_{t}" for t in range(len(tools)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f'call: "<tool_call>\\n" ({alternatives}) "</tool_call>"'
    return "\n".join([start, call, *rules, *_XML_TERMINALS]) + "\n"


def _xml_parameters(t: int, tool: dict, rules: list[str]) -> str:
    parameters = _tool_parameters(tool)
    declared = parameter_schema.properties(parameters)
    if not declared:
        return '("<parameter=" PARAMETER_NAME ">\\n" XML_VALUE)*'
    needed = parameter_schema.required(parameters)
    items = []
    for p, (key, schema) in enumerate(declared.items()):
        rule = f"fn_{t}_p{p}"
        value = _xml_value(schema, parameters)
        rules.append(f"{rule}: {lark_string(f'<parameter={key}>' + chr(10))} {value}")
        items.append(rule if key in needed else f"{rule}?")
    return " ".join(items) if items else ""


def _xml_value(schema: dict, parameters: dict) -> str:
    """A plain string is free text up to the first `\\n</parameter>` (the format's only
    terminator); a string enum / const is one of its values; all-non-string types are JSON
    valid against the schema (`%json`, as typed_value.py reads them). A string with length
    / pattern / format limits, or a union of string with other types, is free text: the
    XML value has no quotes that would tell "1" from 1. A tool that declares no properties
    takes any parameters, each free text."""
    resolved = parameter_schema.resolve(schema, parameters)
    types = parameter_schema.types(resolved, parameters)
    close = '"\\n</parameter>\\n"'
    values = resolved.get("enum", [resolved["const"]] if "const" in resolved else None)
    if types == ["string"] and isinstance(values, list) and values:
        return f"({' | '.join(lark_string(v) for v in values)}) {close}"
    if types and "string" not in types:
        return f"{_json_rule(schema, parameters)} {close}"
    return "XML_VALUE"


# ---- pythonic ----------------------------------------------------------------------------
def pythonic_call_grammar(tools: list[dict], parallel: bool) -> str:
    rules = []
    for t, tool in enumerate(tools):
        head = lark_string(f"{tool['name']}(")
        rules.append(f'fn_{t}: {head} {_keywords(t, tool, rules)} ")"')
    alternatives = " | ".join(f"fn_{t}" for t in range(len(tools)))
    calls = 'call (", " call)*' if parallel else "call"
    lines = [f'start: "[" {calls} "]"', f"call: {alternatives}", *rules]
    lines.append(f"KEYWORD: /[A-Za-z_][A-Za-z0-9_]{{0,{MAX_NAME_CHARS - 1}}}/")
    return "\n".join(lines) + "\n"


def _keywords(t: int, tool: dict, rules: list[str]) -> str:
    """The keyword list of one tool; each optional keyword may be left out, and a comma
    goes only between two written keywords."""
    parameters = _tool_parameters(tool)
    declared = parameter_schema.properties(parameters)
    if not declared:
        any_value = "%json {}"
        rules.append(f'fn_{t}_any: KEYWORD "=" {any_value} (", " KEYWORD "=" {any_value})*')
        return f"fn_{t}_any?"
    needed = parameter_schema.required(parameters)
    items = []
    for p, (key, schema) in enumerate(declared.items()):
        rule = f"fn_{t}_p{p}"
        rules.append(f"{rule}: {lark_string(key + '=')} {_python_value(schema, parameters)}")
        items.append((rule, key in needed))
    # after_i: keywords from i on once one was written; first_i: a non-empty list from i
    # on when none was.
    n = len(items)
    for i in reversed(range(n)):
        rule, is_required = items[i]
        after = f" fn_{t}_after{i + 1}" if i + 1 < n else ""
        if is_required:
            rules.append(f'fn_{t}_after{i}: ", " {rule}{after}')
            rules.append(f"fn_{t}_first{i}: {rule}{after}")
        else:
            rules.append(f'fn_{t}_after{i}: (", " {rule})?{after}')
            rest = f" | fn_{t}_first{i + 1}" if i + 1 < n else ""
            rules.append(f"fn_{t}_first{i}: {rule}{after}{rest}")
    all_optional = not any(is_required for _, is_required in items)
    return f"fn_{t}_first0?" if all_optional else f"fn_{t}_first0"


def _python_value(schema: dict, parameters: dict) -> str:
    """A boolean is True / False, a null None; every other value is JSON valid against its
    schema (`%json`: a JSON string is a Python string literal, and the pythonic parser
    reads JSON before Python literals, so nested true / false / null are read too). A tool
    that declares no properties takes any keywords, each a JSON value."""
    resolved = parameter_schema.resolve(schema, parameters)
    plain = not any(k in resolved for k in ("enum", "const"))
    types = parameter_schema.types(resolved, parameters)
    if plain and types == ["boolean"]:
        return '("True" | "False")'
    if plain and types == ["null"]:
        return '"None"'
    return _json_rule(schema, parameters)
