"""Lark grammars (llguidance's dialect) that admit only well-formed tool calls.

Each tool becomes its own `%json` rule: an object `{"name": <that name>, "arguments":
<its parameters schema>}`. A rule per tool (rather than one anyOf schema) keeps each
tool's `$defs` / `definitions` at its schema's root, where its `$ref`s point. JSON
whitespace is bounded, as for every JSON constraint (structured_outputs.py).
"""

from __future__ import annotations

import json

from services.common.structured_outputs import BOUNDED_JSON_WHITESPACE

_DEFINITION_KEYS = ("$defs", "definitions")


def call_schema(name: str, parameters: dict | None, arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call of one tool, name first (llguidance keeps the order)."""
    parameters = dict(parameters) if parameters else {"type": "object", "properties": {}}
    hoisted = {key: parameters.pop(key) for key in _DEFINITION_KEYS if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        **hoisted,
        "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": BOUNDED_JSON_WHITESPACE},
    }


def arguments_schema(tool: dict) -> str:
    """A tool's parameters schema alone (formats that name the call outside the JSON), as
    the text of a `%json` rule, with the same bounded whitespace."""
    parameters = tool.get("parameters") or {"type": "object", "properties": {}}
    whitespace = {"whitespace_flexible": True, "whitespace_pattern": BOUNDED_JSON_WHITESPACE}
    return json.dumps({**parameters, "x-guidance": whitespace})


def lark_string(text: str) -> str:
    """A Lark literal matching `text` exactly (JSON escapes are Lark escapes)."""
    return json.dumps(text)


def tool_rules(tools: list[dict], arguments_key: str = "arguments") -> tuple[str, list[str]]:
    """(the alternation of the tools' rule names, the rules themselves)."""
    names = [f"tool_{i}" for i in range(len(tools))]
    rules = [
        f"{rule}: %json {json.dumps(call_schema(t['name'], t.get('parameters'), arguments_key))}"
        for rule, t in zip(names, tools, strict=True)
    ]
    return " | ".join(names), rules
