"""Qwen3-Coder tool calls: XML with one tag per parameter (xml_call_stream.py); values are
typed by the request's tool schemas."""

from __future__ import annotations

from services.frontend.tool_parsers.base import ToolCallStream, ToolParser
from services.frontend.tool_parsers.parameter_grammar import xml_call_grammar
from services.frontend.tool_parsers.xml_call_stream import XmlCallStream


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def stream(self) -> ToolCallStream:
        return XmlCallStream(self.max_calls, self.tools)

    def constraint_grammar(self, tools: list[dict], parallel: bool) -> str:
        return xml_call_grammar(tools, parallel)
