"""Parsed tool-call output (tool_parsers) in OpenAI's response shapes: stream deltas and
the final assistant message, plus the finish reason a response with calls reports."""

from __future__ import annotations

from services.frontend.openai.replies import (
    ChatMessageOut,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from services.frontend.tool_parsers import ExtractedToolCalls, ParsedDelta


def delta_message(parsed: ParsedDelta) -> DeltaMessage:
    if not parsed.tool_calls:  # most deltas: text only
        return DeltaMessage(
            content=parsed.content or None, reasoning_content=parsed.reasoning or None
        )
    calls = [
        DeltaToolCall(
            index=piece.index,
            id=piece.id,
            type="function" if piece.id is not None else None,
            function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
        )
        for piece in parsed.tool_calls
    ]
    return DeltaMessage(
        content=parsed.content or None,
        reasoning_content=parsed.reasoning or None,
        tool_calls=calls or None,
    )


def message_out(extracted: ExtractedToolCalls) -> ChatMessageOut:
    calls = [
        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in extracted.tool_calls
    ]
    return ChatMessageOut(content=extracted.content, tool_calls=calls or None)


def finish_reason(reason: str, num_calls: int) -> str:
    """A model that stopped after calling tools finished with "tool_calls" (OpenAI's);
    "length" stays: its last call may be cut short."""
    return "tool_calls" if num_calls and reason == "stop" else reason
