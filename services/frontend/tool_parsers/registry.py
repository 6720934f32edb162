"""--tool-call-parser names -> parser classes (vLLM's names)."""

from __future__ import annotations

from services.frontend.tool_parsers.base import ToolParser
from services.frontend.tool_parsers.hermes import HermesToolParser
from services.frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from services.frontend.tool_parsers.mistral import MistralToolParser
from services.frontend.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from services.frontend.tool_parsers.pythonic import PythonicToolParser
from services.frontend.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        Phi4MiniJsonToolParser,
        PythonicToolParser,
        Qwen3CoderToolParser,
    )
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; known: {known}.") from None
