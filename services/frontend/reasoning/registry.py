"""--reasoning-parser names -> parser classes (vLLM's names)."""

from __future__ import annotations

from services.frontend.reasoning.base import ReasoningParser
from services.frontend.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from services.frontend.reasoning.mistral import MistralReasoningParser
from services.frontend.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, MistralReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}.") from None
