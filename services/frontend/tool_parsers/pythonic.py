"""Pythonic tool calls (Llama 3.2, Llama 4): `[func(a=1, b="x"), ...]`, read by
pythonic_call_stream.py; the grammar writes keywords (parameter_grammar.py)."""

from __future__ import annotations

from services.frontend.tool_parsers.base import ToolCallStream, ToolParser
from services.frontend.tool_parsers.parameter_grammar import pythonic_call_grammar
from services.frontend.tool_parsers.pythonic_call_stream import PythonicCallStream


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def stream(self) -> ToolCallStream:
        return PythonicCallStream(self.max_calls)

    def constraint_grammar(self, tools: list[dict], parallel: bool) -> str:
        return pythonic_call_grammar(tools, parallel)
