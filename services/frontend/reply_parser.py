"""ReplyParser: one choice's reply text -> thinking, answer and tool-call deltas.

The reasoning stream splits the thinking off first; only the answer goes through the
tool-call stream (a model thinking about a call is not making one), as vLLM does. Every
API that renders chat replies (OpenAI chat and Responses, Anthropic Messages, gRPC)
parses through here, so they split a reply the same way.
"""

from __future__ import annotations

from services.common.reasoning_bounds import ReasoningMode
from services.frontend.reasoning import ReasoningStream
from services.frontend.tool_parsers import ParsedDelta
from services.frontend.tool_parsers.base import ToolCallStream


class ReplyParser:
    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        # Still inside the thinking (the answer has not begun): set by every feed.
        self.thinking = reasoning is not None and reasoning.thinking

    def feed(self, text: str, final: bool = False) -> ParsedDelta:
        """The parsed delta of new text; `final`: the reply ended, release what was held."""
        reasoning, answer = "", text
        if self.reasoning is not None:
            split = self.reasoning.feed(text)
            if final:
                rest = self.reasoning.finish()
                split.reasoning += rest.reasoning
                split.content += rest.content
            reasoning, answer = split.reasoning, split.content
            self.thinking = self.reasoning.mode == ReasoningMode.THINKING
        if self.tools is None:
            return ParsedDelta(content=answer, reasoning=reasoning)
        # A tool stream has read all it was given: empty text would change nothing.
        parsed = self.tools.feed(answer) if answer else ParsedDelta()
        if final:
            parsed.extend(self.tools.finish())
        parsed.reasoning = reasoning  # a tool stream's deltas are its own, fresh each feed
        return parsed

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0
