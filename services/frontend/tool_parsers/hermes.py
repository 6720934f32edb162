"""Hermes / Qwen / ChatML tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, optionally after some content (NousResearch's Hermes 2 Pro format,
also what the shipped tool-aware ChatML template teaches)."""

from __future__ import annotations

from services.frontend.marker_hold import held_marker_suffix
from services.frontend.tool_parsers.base import ToolCallStream, ToolParser
from services.frontend.tool_parsers.grammar import lark_string, tool_rules
from services.frontend.tool_parsers.json_call_stream import JsonCallStream

START, END = "<tool_call>", "</tool_call>"


class HermesCallStream(JsonCallStream):
    start_marker = START

    def _find(self, final: bool) -> tuple[int, int] | int:
        index = self.text.find(START, self.pos)
        if index < 0:
            held = 0 if final else held_marker_suffix(self.text, START)
            return len(self.text) - held
        return index, index + len(START)

    def find_first_call(self, final: bool) -> tuple[int, int] | int:
        return self._find(final)

    def find_next_call(self, final: bool) -> tuple[int, int] | int:
        return self._find(final)


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolCallStream:
        return HermesCallStream(self.max_calls)

    def constraint_grammar(self, tools: list[dict], parallel: bool) -> str:
        alternatives, rules = tool_rules(tools)
        call = f"{lark_string(START + chr(10))} ({alternatives}) {lark_string(chr(10) + END)}"
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, f"call: {call}", *rules]) + "\n"
