"""ResponseOutputBuilder: a chat choice's deltas (thinking, text, tool-call pieces,
logprobs) as the Responses API's output items, and the stream events that build them.

Thinking opens a `reasoning` item, closed when the answer begins; text a `message` item,
open until a tool call starts or the response ends; each tool call a `function_call`
item. A streamed and a non-streamed response go through the same builder (the latter
drops the events), so both have the same output. Events carry no sequence_number (the
stream numbers them as it sends them).
"""

from __future__ import annotations

from services.frontend.openai.replies import ChatLogprobEntry, DeltaMessage, DeltaToolCall
from services.frontend.openai.response_object import (
    FunctionCallOutputItem,
    ItemStatus,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningOutputItem,
    ReasoningText,
)


class ResponseOutputBuilder:
    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._reasoning: ReasoningOutputItem | None = None  # the open reasoning item
        self._message: OutputMessage | None = None  # the open message item
        self._calls: dict[int, FunctionCallOutputItem] = {}  # open calls, by call index
        self._logprobs: list[ChatLogprobEntry] = []  # not yet sent with a text delta

    def feed(self, delta: DeltaMessage, logprobs: list[ChatLogprobEntry] | None) -> list[dict]:
        events: list[dict] = []
        self._logprobs.extend(logprobs or [])
        if delta.reasoning_content:
            if self._reasoning is None:
                events += self._open_reasoning()
            events.append(self._reasoning_delta(delta.reasoning_content))
        if delta.content or delta.tool_calls:
            events += self._close_reasoning("completed")
        if delta.content:
            if self._message is None:
                events += self._open_message()
            events.append(self._text_delta(delta.content))
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                events += self._close_message("completed")
                events += self._close_calls("completed")
                events += self._open_call(piece)
            events += self._arguments_delta(piece)
        return events

    def finish(self, status: ItemStatus) -> list[dict]:
        """Close what is open (an empty reply is one empty message)."""
        events = self._close_reasoning(status)
        if not any(not isinstance(item, ReasoningOutputItem) for item in self.items):
            events += self._open_message()
        return events + self._close_message(status) + self._close_calls(status)

    # ---- thinking ------------------------------------------------------------------------
    def _open_reasoning(self) -> list[dict]:
        item = self._reasoning = ReasoningOutputItem(content=[ReasoningText()])
        index = self._add(item)
        return [
            {"type": "response.output_item.added", "output_index": index, "item": _empty(item)},
            {
                "type": "response.content_part.added",
                **self._where(item),
                "part": ReasoningText().model_dump(),
            },
        ]

    def _reasoning_delta(self, text: str) -> dict:
        item = self._reasoning
        item.content[0].text += text
        return {"type": "response.reasoning_text.delta", **self._where(item), "delta": text}

    def _close_reasoning(self, status: ItemStatus) -> list[dict]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        item.status = status
        where = self._where(item)
        part = item.content[0]
        return [
            {"type": "response.reasoning_text.done", **where, "text": part.text},
            {"type": "response.content_part.done", **where, "part": part.model_dump()},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": item.model_dump(),
            },
        ]

    # ---- messages ----------------------------------------------------------------------
    def _open_message(self) -> list[dict]:
        events = self._close_calls("completed")
        message = self._message = OutputMessage()
        index = self._add(message)
        part = OutputText()
        message.content.append(part)
        return [
            *events,
            {"type": "response.output_item.added", "output_index": index, "item": _empty(message)},
            {
                "type": "response.content_part.added",
                **self._where(message),
                "part": part.model_dump(),
            },
        ]

    def _text_delta(self, text: str) -> dict:
        message = self._message
        part = message.content[0]
        part.text += text
        logprobs, self._logprobs = self._logprobs, []
        part.logprobs += logprobs
        return {
            "type": "response.output_text.delta",
            **self._where(message),
            "delta": text,
            "logprobs": [entry.model_dump() for entry in logprobs],
        }

    def _close_message(self, status: ItemStatus) -> list[dict]:
        message, self._message = self._message, None
        if message is None:
            return []
        part = message.content[0]
        part.logprobs += self._logprobs
        self._logprobs = []
        message.status = status
        where = self._where(message)
        return [
            {
                "type": "response.output_text.done",
                **where,
                "text": part.text,
                "logprobs": [entry.model_dump() for entry in part.logprobs],
            },
            {"type": "response.content_part.done", **where, "part": part.model_dump()},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": message.model_dump(),
            },
        ]

    # ---- function calls ----------------------------------------------------------------
    def _open_call(self, piece: DeltaToolCall) -> list[dict]:
        call = FunctionCallOutputItem(call_id=piece.id, name=piece.function.name or "")
        self._calls[piece.index] = call
        index = self._add(call)
        return [{"type": "response.output_item.added", "output_index": index, "item": _empty(call)}]

    def _arguments_delta(self, piece: DeltaToolCall) -> list[dict]:
        call = self._calls.get(piece.index)
        arguments = piece.function.arguments
        if call is None or not arguments:
            return []
        call.arguments += arguments
        return [
            {
                "type": "response.function_call_arguments.delta",
                "item_id": call.id,
                "output_index": self.items.index(call),
                "delta": arguments,
            }
        ]

    def _close_calls(self, status: ItemStatus) -> list[dict]:
        events = []
        for call in self._calls.values():
            call.status = status
            index = self.items.index(call)
            events += [
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": call.id,
                    "output_index": index,
                    "arguments": call.arguments,
                },
                {
                    "type": "response.output_item.done",
                    "output_index": index,
                    "item": call.model_dump(),
                },
            ]
        self._calls.clear()
        return events

    # ---- helpers -----------------------------------------------------------------------
    def _add(self, item: OutputItem) -> int:
        self.items.append(item)
        return len(self.items) - 1

    def _where(self, message: OutputMessage | ReasoningOutputItem) -> dict:
        return {
            "item_id": message.id,
            "output_index": self.items.index(message),
            "content_index": 0,
        }


def _empty(item: OutputItem) -> dict:
    """An item as it is announced: in progress, no content or arguments yet."""
    if isinstance(item, OutputMessage | ReasoningOutputItem):
        return item.model_dump() | {"content": []}
    return item.model_dump() | {"arguments": ""}
