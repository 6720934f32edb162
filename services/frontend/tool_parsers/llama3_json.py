"""Llama 3.x JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), several separated by `;`. A reply that does not start
with a call is plain content, as in vLLM's llama3_json parser."""

from __future__ import annotations

from services.frontend.tool_parsers.base import ToolCallStream, ToolParser
from services.frontend.tool_parsers.grammar import tool_rules
from services.frontend.tool_parsers.json_call_stream import JsonCallStream

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonCallStream(JsonCallStream):
    argument_keys = ("parameters", "arguments")

    def find_first_call(self, final: bool) -> tuple[int, int] | int:
        rest = self.text.lstrip()
        content_end = len(self.text) - len(rest)
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG) :].lstrip()
        if rest.startswith("{"):
            return content_end, len(self.text) - len(rest)
        if not final and PYTHON_TAG.startswith(rest) and self.pos == 0:
            return 0  # "", or a prefix of the python tag: wait
        self.mode = "raw"  # not a call: all of it is content
        return len(self.text)

    def find_next_call(self, final: bool) -> tuple[int, int] | int:
        index = self.pos
        while index < len(self.text) and (self.text[index].isspace() or self.text[index] == ";"):
            index += 1
        if index == len(self.text):
            return index
        if self.text[index] == "{":
            return index, index
        self.mode = "done"  # anything else after the calls is dropped
        return len(self.text)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return Llama3JsonCallStream(self.max_calls)

    def constraint_grammar(self, tools: list[dict], parallel: bool) -> str:
        alternatives, rules = tool_rules(tools, arguments_key="parameters")
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return "\n".join([start, f"call: {alternatives}", *rules]) + "\n"
