"""Tool-call parsers: read a model's tool calls from its text, streamed or whole, and
constrain `required` / named-function requests to the same format (see base.py)."""

from services.frontend.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    assemble,
)
from services.frontend.tool_parsers.detect import detect_tool_parser
from services.frontend.tool_parsers.registry import TOOL_PARSERS, get_tool_parser

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCalls",
    "ParsedDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "assemble",
    "detect_tool_parser",
    "get_tool_parser",
]
