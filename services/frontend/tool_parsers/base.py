"""What every tool-call parser gives the chat endpoint: a per-choice stream, a whole-text
extraction, and the grammar that makes a model write calls in the parser's own format.

Why one stream for both paths: `extract(text)` feeds the whole text through the same
`ToolCallStream` a streamed response uses, so the streamed deltas always assemble to the
non-streamed message, whatever the chunk boundaries (vLLM's parsers have separate
streaming and non-streaming code, which can disagree).
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def tool_call_id() -> str:
    """OpenAI-style id: call_ and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One piece of one call: the first carries id and name, later ones only arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)  # one per streamed token
class ParsedDelta:
    """New reply text, split: the model's thinking (reasoning parsers), the answer's
    content, and tool-call pieces read from the answer (tool parsers)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls or self.reasoning)

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """A whole message: content None when the model wrote only tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


def assemble(deltas: list[ParsedDelta]) -> ExtractedToolCalls:
    """Join deltas into the message they describe (what a client does with a stream)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = calls.setdefault(piece.index, ToolCall(piece.id or "", piece.name or "", ""))
            call.arguments += piece.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    if tool_calls and not content:
        return ExtractedToolCalls(None, tool_calls)
    return ExtractedToolCalls(content, tool_calls)


class ToolCallStream(ABC):
    """One choice's parser state: feed text deltas, get content and tool-call deltas. The
    reply so far is `text`; a format's `_advance` reads as much of it as it can settle."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.text = ""
        self.pos = 0  # where reading resumes
        self._num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        out = ParsedDelta()
        self._advance(out, final=False)
        return out

    @abstractmethod
    def _advance(self, out: ParsedDelta, final: bool) -> None:
        """Read what the text so far settles into `out` (`final`: no more text comes)."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The model stopped: flush whatever was held back."""

    @property
    def num_calls(self) -> int:
        return self._num_calls


class ToolParser(ABC):
    """A model family's tool-call format. `max_calls` is 1 when parallel_tool_calls is off;
    `tools` ({"name", "parameters"} each) are the request's functions, for formats whose
    arguments are typed by the schema (qwen3_coder's XML values)."""

    name: str = ""

    def __init__(self, max_calls: int | None = None, tools: list[dict] | None = None) -> None:
        self.max_calls = max_calls
        self.tools = tools or []

    @abstractmethod
    def stream(self) -> ToolCallStream: ...

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self.stream()
        return assemble([stream.feed(text), stream.finish()])

    @abstractmethod
    def constraint_grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) that admits only calls, in this format, of
        the given tools ({"name", "parameters"} each) with arguments valid against their
        parameters schema: one call, or several when `parallel`."""

    # Special tokens may carry the format's markers (<tool_call> is one in several models),
    # so a parsed response keeps them in the text.
    skip_special_tokens = False
