"""--tool-call-parser names -> parser classes (vLLM's names)."""

from __future__ import annotations

from services.frontend.tool_parsers.base import ToolParser
from services.frontend.tool_parsers.hermes import HermesToolParser
from services.frontend.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known: {known}.") from None
