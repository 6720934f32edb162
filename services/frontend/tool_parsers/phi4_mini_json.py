"""Phi-4-mini tool calls: `functools[{"name": ..., "arguments": {...}}, ...]`, optionally
after some content (its chat template's format; vLLM's phi4_mini_json)."""

from __future__ import annotations

from services.frontend.tool_parsers.base import ToolCallStream, ToolParser
from services.frontend.tool_parsers.grammar import lark_string, tool_rules
from services.frontend.tool_parsers.json_list_call_stream import JsonListCallStream

MARKER = "functools["


class Phi4MiniJsonCallStream(JsonListCallStream):
    marker = MARKER


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"

    def stream(self) -> ToolCallStream:
        return Phi4MiniJsonCallStream(self.max_calls)

    def constraint_grammar(self, tools: list[dict], parallel: bool) -> str:
        alternatives, rules = tool_rules(tools)
        calls = 'call (", " call)*' if parallel else "call"
        start = f'start: {lark_string(MARKER)} {calls} "]"'
        return "\n".join([start, f"call: {alternatives}", *rules]) + "\n"
