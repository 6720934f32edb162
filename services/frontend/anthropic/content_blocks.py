"""ContentBlocks: one reply's parsed deltas as Anthropic content blocks and the stream
events that build them.

The streamed events and the final `content` come from the same blocks, so a client that
accumulates the events gets the non-streamed message.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from services.frontend.tool_parsers import ParsedDelta

__all__ = ["ContentBlocks", "tool_use_id"]


def tool_use_id() -> str:
    """Anthropic-style id, for a call the parser gave no id: toolu_ and 24 hex digits.
    A call keeps the tool-call parser's own id (call_ + 24 hex for most formats, 9
    alphanumerics for mistral's): the client sends it back in the next turn, and a model's
    chat template may check its form."""
    return f"toolu_{uuid.uuid4().hex[:24]}"


@dataclass
class _Block:
    kind: str  # "thinking", "text" or "tool_use"
    text: str = ""  # the thinking, the text, or the tool input's JSON so far
    call_index: int | None = None  # tool_use: the parser's call index
    id: str = ""
    name: str = ""

    def opening(self) -> dict:
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": "", "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": ""}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": {}}

    def delta(self, text: str) -> dict:
        if self.kind == "thinking":
            return {"type": "thinking_delta", "thinking": text}
        if self.kind == "text":
            return {"type": "text_delta", "text": text}
        return {"type": "input_json_delta", "partial_json": text}

    def final(self) -> dict:
        if self.kind == "thinking":
            return {"type": "thinking", "thinking": self.text, "signature": ""}
        if self.kind == "text":
            return {"type": "text", "text": self.text}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": _input(self.text)}


class ContentBlocks:
    """The blocks of one reply. A block is opened whenever the kind of text changes
    (thinking, text, one block per tool call) and closed before the next one opens; blocks
    are indexed from 0 in the order they open. Within one parsed delta the thinking comes
    first, then the answer's text, then its tool-call pieces (the order the reply parser
    reads them in). A tool_use block's id: `tool_use_id`.
    """

    def __init__(self) -> None:
        self.blocks: list[_Block] = []
        self._open: _Block | None = None
        self._calls: dict[int, tuple[str, str]] = {}  # call index -> (id, name)

    def feed(self, parsed: ParsedDelta) -> list[dict]:
        """The events for new parsed text."""
        events: list[dict] = []
        if parsed.reasoning:
            events += self._add("thinking", parsed.reasoning)
        if parsed.content:
            events += self._add("text", parsed.content)
        for piece in parsed.tool_calls:
            events += self._add_call(piece.index, piece.id, piece.name, piece.arguments)
        return events

    def close(self) -> list[dict]:
        """The events that end the last block (the reply is over)."""
        block, self._open = self._open, None
        if block is None:
            return []
        events = []
        if block.kind == "thinking":  # Anthropic ends every thinking block with its signature
            delta = {"type": "signature_delta", "signature": ""}
            events.append(_event("content_block_delta", self._index(block), delta=delta))
        events.append(_event("content_block_stop", self._index(block)))
        return events

    @property
    def num_tool_uses(self) -> int:
        return len(self._calls)

    def content(self) -> list[dict]:
        return [block.final() for block in self.blocks]

    def _add(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open.kind != kind:
            events += self._start(_Block(kind))
        return events + self._extend(text)

    def _add_call(self, index: int, call_id: str | None, name: str | None, arguments: str):
        events = []
        block = self._open
        if block is None or block.kind != "tool_use" or block.call_index != index:
            if index not in self._calls:
                self._calls[index] = (call_id or tool_use_id(), name or "")
            use_id, use_name = self._calls[index]
            events += self._start(_Block("tool_use", call_index=index, id=use_id, name=use_name))
        if arguments:
            events += self._extend(arguments)
        return events

    def _start(self, block: _Block) -> list[dict]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        start = _event("content_block_start", self._index(block), content_block=block.opening())
        return [*events, start]

    def _extend(self, text: str) -> list[dict]:
        block = self._open
        assert block is not None
        block.text += text
        return [_event("content_block_delta", self._index(block), delta=block.delta(text))]

    def _index(self, block: _Block) -> int:
        assert self.blocks[-1] is block  # only the newest block is ever open
        return len(self.blocks) - 1


def _event(kind: str, index: int, **fields) -> dict:
    return {"type": kind, "index": index, **fields}


def _input(arguments: str) -> dict:
    """A call's input object; a call cut short (max_tokens) may not be JSON yet: {}."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
