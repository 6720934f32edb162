"""Reasoning parsers: a reasoning model's thinking kept apart from its answer (base.py)."""

from services.frontend.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream
from services.frontend.reasoning.registry import REASONING_PARSERS, get_reasoning_parser

__all__ = [
    "REASONING_PARSERS",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]
