"""A Responses API request's `input` as the chat messages the chat endpoint renders.

`input` is a string (one user message) or a list of items: messages, `function_call`
items (joining the assistant message before them as its `tool_calls`) and
`function_call_output` items (`tool` messages). `reasoning` items are accepted and left
out (chat templates drop earlier turns' thinking); a message's `input_image` parts become
the chat's image_url parts (a vision-language model's images); anything else (files, item
references) is a 400 naming the item. A response's output goes back into a conversation
the same way (`output_message`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from services.frontend.openai.chat_messages import (
    ChatMessage,
    ContentPart,
    FunctionCallIn,
    ToolCallIn,
)
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.response_object import new_id

TEXT_PART_TYPES = ("input_text", "output_text", "text")


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItemIn(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningItemIn(_Item):
    type: Literal["reasoning"]


_ITEMS = {
    "message": MessageItem,
    "function_call": FunctionCallItemIn,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItemIn,
}


def input_messages(items: str | list, param: str = "input") -> list[ChatMessage]:
    """The chat messages of a request's input (400 naming the item on a bad one)."""
    if isinstance(items, str):
        if not items:
            raise InvalidRequestError(f"{param} must not be empty.", param)
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise InvalidRequestError(f"{param} must not be an empty list.", param)
    messages: list[ChatMessage] = []
    for i, raw in enumerate(items):
        _append(messages, _parse(raw, f"{param}[{i}]"), f"{param}[{i}]")
    return messages


def _parse(raw, where: str) -> _Item:
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{where} must be an object (an input item).", where)
    kind = raw.get("type", "message" if "role" in raw else None)
    model = _ITEMS.get(kind)
    if model is None:
        known = ", ".join(_ITEMS)
        raise InvalidRequestError(
            f"{where}.type {kind!r} is not supported; the input items this server takes are "
            f"{known}.",
            f"{where}.type",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"] if not _is_type_label(part))
        path = f"{where}.{field}" if field else where
        raise InvalidRequestError(f"{path}: {first['msg']}", path) from None


def _is_type_label(part) -> bool:
    """pydantic's union-member labels in an error's loc ("str", "list[dict[str,any]]")."""
    return part in ("str", "int", "float", "bool") or "[" in str(part)


def _append(messages: list[ChatMessage], item: _Item, where: str) -> None:
    if isinstance(item, MessageItem):
        content = _content(item.content, f"{where}.content")
        messages.append(ChatMessage(role=item.role, content=content))
    elif isinstance(item, FunctionCallItemIn):
        _check_arguments(item.arguments, f"{where}.arguments")
        call = ToolCallIn(
            id=item.call_id, function=FunctionCallIn(name=item.name, arguments=item.arguments)
        )
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
    elif isinstance(item, FunctionCallOutputItem):
        content = _text(item.output, f"{where}.output")
        messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=content))


def _text(content: str | list[dict], where: str) -> str:
    """A content string, or its text parts joined (the chat template sees one string)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{where}[{j}].type {kind!r} is not supported: this server takes text parts "
                f"only ({', '.join(TEXT_PART_TYPES[:2])} with a text string).",
                f"{where}[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def _content(content: str | list[dict], where: str) -> str | list[ContentPart]:
    """A message's content: its text (_text), or with input_image parts its chat parts."""
    if isinstance(content, str) or all(p.get("type") != "input_image" for p in content):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "input_image":
            parts.append(ContentPart(type="text", text=_text([part], f"{where}[{j}]")))
            continue
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(
                f"{where}[{j}]: an input_image needs an image_url (a data URL or a URL); "
                "file_id is not supported.",
                f"{where}[{j}].image_url",
            )
        parts.append(ContentPart(type="image_url", image_url=url))
    return parts


def _check_arguments(arguments: str, where: str) -> None:
    try:
        json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where} is not valid JSON: {exc}", where) from None


def input_items(items: str | list) -> list[dict]:
    """The input as OpenAI's item objects (GET /v1/responses/{id}/input_items): each with
    an id (the client's, else a new one) and status completed; call after input_messages
    has checked it."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    return [_item_object(raw, _parse(raw, "input")) for raw in items]


def _item_object(raw: dict, item: _Item) -> dict:
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        content = item.content
        if isinstance(content, str):
            content = [{"type": kind, "text": content}]
        body = {"type": "message", "role": item.role, "content": content}
        prefix = "msg"
    elif isinstance(item, FunctionCallItemIn):
        body = item.model_dump()
        prefix = "fc"
    else:
        body = item.model_dump()
        prefix = "fco"
    return {"id": raw.get("id") or new_id(prefix), **body, "status": "completed"}


def output_message(text: str | None, calls: list[ToolCallIn]) -> ChatMessage:
    """A response's output as the assistant message a conversation continues from."""
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)
