"""An Anthropic Messages body as the internal chat request (ChatCompletionRequest), once.

After this the request runs the chat endpoint's own path (limits, the template with the
tools, the tool plan, SamplingParams), so a Messages request and the chat completion of
the same conversation see the same prompt and engine request. Blocks become chat messages
in order (system first, a tool_result a `tool` message, a user's image an image_url part);
what has no chat equivalent (documents, images in tool results, server tools, an assistant
prefill) is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from services.frontend.anthropic.messages_request import (
    CountTokensRequest,
    ImageBlock,
    InputMessage,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from services.frontend.openai.chat_messages import (
    ChatMessage,
    ChatTool,
    ContentPart,
    FunctionCallIn,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    ToolCallIn,
)
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.protocol import ChatCompletionRequest

__all__ = ["to_chat_request"]

CUSTOM_TOOL_TYPES = (None, "custom")
BETWEEN_MESSAGES = "\n\n"  # joins the texts of consecutive same-role messages


def to_chat_request(request: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) body means; InvalidRequestError naming
    the field for what has no chat equivalent."""
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": _system(request.system) + _conversation(request.messages),
        "tools": _tools(request.tools),
        **_tool_choice(request.tool_choice),
        **_thinking(request),
    }
    if isinstance(request, MessagesRequest):
        _refuse_prefill(request.messages)
        fields |= {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "stream": request.stream,
        }
    return ChatCompletionRequest(**fields)


def _system(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    if isinstance(system, str):
        return [ChatMessage(role="system", content=system)]
    return [ChatMessage(role="system", content=[_part(b.text) for b in system])]


def _conversation(messages: list[InputMessage]) -> list[ChatMessage]:
    """The messages as chat messages; consecutive user (or assistant) ones become one:
    Anthropic allows them, while many chat templates insist on alternating turns. Tool
    messages stay as they are, so [tool_result, text] is a tool message then a user one
    (what OpenAI-shaped templates expect after a call)."""
    out: list[ChatMessage] = []
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            turn = [ChatMessage(role=message.role, content=message.content)]
        elif message.role == "user":
            turn = _user_turn(message.content, f"messages[{i}]")
        else:
            turn = [_assistant_turn(message.content, f"messages[{i}]")]
        for chat_message in turn:
            if out and out[-1].role == chat_message.role != "tool":
                out[-1] = _merged(out[-1], chat_message)
            else:
                out.append(chat_message)
    return out


def _merged(first: ChatMessage, second: ChatMessage) -> ChatMessage:
    """Two consecutive user (or assistant) messages as one: texts joined by a blank line,
    then the calls and the thinking of both, in order."""
    before, after = _parts(first), _parts(second)
    between = [_part(BETWEEN_MESSAGES)] if before and after else []
    parts = before + between + after
    calls = (first.tool_calls or []) + (second.tool_calls or [])
    thinking = [t for t in (first.reasoning_content, second.reasoning_content) if t is not None]
    return ChatMessage(
        role=first.role,
        content=parts if parts or not calls else None,
        tool_calls=calls or None,
        reasoning_content=BETWEEN_MESSAGES.join(thinking) if thinking else None,
    )


def _parts(message: ChatMessage) -> list[ContentPart]:
    if message.content is None:
        return []
    if isinstance(message.content, str):
        return [_part(message.content)]
    return list(message.content)


def _refuse_prefill(messages: list[InputMessage]) -> None:
    if messages and messages[-1].role == "assistant":
        raise InvalidRequestError(
            f"messages[{len(messages) - 1}]: prefilling the assistant turn (a final assistant "
            "message for the model to continue) is not supported; end with a user message.",
            "messages",
        )


def _user_turn(blocks: list, where: str) -> list[ChatMessage]:
    """Text blocks as user messages and tool results as tool messages, in block order."""
    out: list[ChatMessage] = []
    parts: list[ContentPart] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, TextBlock):
            parts.append(_part(block.text))
        elif isinstance(block, ImageBlock) and block.type == "image":
            parts.append(ContentPart(type="image_url", image_url=_image_url(block, at)))
        elif isinstance(block, ToolResultBlock):
            if parts:
                out.append(ChatMessage(role="user", content=parts))
                parts = []
            out.append(_tool_result(block, at))
        else:
            _refuse(block, at, "a user message")
    if parts:
        out.append(ChatMessage(role="user", content=parts))
    return out


def _assistant_turn(blocks: list, where: str) -> ChatMessage:
    """Text as content, tool_use as tool_calls (input as JSON; ids pass through: this
    server's are its tool parser's, in the form the model's template wants), thinking as
    reasoning_content (templates that keep an agent turn's thinking read it); redacted
    thinking is dropped (encrypted by another server: nothing to read)."""
    parts: list[ContentPart] = []
    calls: list[ToolCallIn] = []
    thinking: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append(_part(block.text))
        elif isinstance(block, ToolUseBlock):
            function = FunctionCallIn(name=block.name, arguments=json.dumps(block.input))
            calls.append(ToolCallIn(id=block.id, function=function))
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif not isinstance(block, RedactedThinkingBlock):
            _refuse(block, f"{where}.content[{j}]", "an assistant message")
    return ChatMessage(
        role="assistant",
        content=parts if parts or not calls else None,
        tool_calls=calls or None,
        reasoning_content="".join(thinking) if thinking else None,
    )


def _tool_result(block: ToolResultBlock, where: str) -> ChatMessage:
    """A `tool` message; is_error is said in its text ("Error: ..."): chat templates have
    no field for it."""
    if isinstance(block.content, str):
        text = block.content
    else:
        for k, part in enumerate(block.content):
            if isinstance(part, ImageBlock):
                _refuse(part, f"{where}.content[{k}]", "a tool result")
        text = "".join(part.text for part in block.content)
    if block.is_error:
        text = f"Error: {text}"
    return ChatMessage(role="tool", content=text, tool_call_id=block.tool_use_id)


def _image_url(block: ImageBlock, where: str) -> str:
    """An image block's source as the chat's image_url: base64 data as a data URL."""
    source = block.source or {}
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type")
        if not isinstance(media_type, str) or not media_type.startswith("image/"):
            raise InvalidRequestError(
                f"{where}.source.media_type must be an image type (image/png, image/jpeg, ...).",
                "messages",
            )
        return f"data:{media_type};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise InvalidRequestError(
        f"{where}.source must be {{'type': 'base64', 'media_type', 'data'}} or "
        "{'type': 'url', 'url'}.",
        "messages",
    )


def _refuse(block, where: str, container: str):
    if isinstance(block, ImageBlock):
        kind = "images" if block.type == "image" else "documents"
        raise InvalidRequestError(
            f"{where}: {kind} are not supported in {container} (a {block.type} block).",
            "messages",
        )
    raise InvalidRequestError(
        f"{where}: a {block.type} block cannot be in {container}.", "messages"
    )


def _part(text: str) -> ContentPart:
    return ContentPart(type="text", text=text)


def _tools(tools) -> list[ChatTool] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in CUSTOM_TOOL_TYPES:
            raise InvalidRequestError(
                f"tools[{i}]: tools of type {tool.type!r} (Anthropic's server tools) are not "
                "supported; give client tools as {name, description, input_schema}.",
                "tools",
            )
        if tool.input_schema is None:
            raise InvalidRequestError(f"tools[{i}].input_schema: Field required.", "tools")
        function = FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        )
        out.append(ChatTool(function=function))
    return out


def _tool_choice(choice) -> dict[str, Any]:
    """auto / any / tool / none -> "auto" / "required" / the named function / "none"."""
    if choice is None:
        return {}
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError(
                'tool_choice.name: required when tool_choice.type is "tool".', "tool_choice"
            )
        fields["tool_choice"] = NamedToolChoice(function=FunctionName(name=choice.name))
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


def _thinking(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """enabled -> enable_thinking with thinking_token_budget = budget_tokens; adaptive ->
    enable_thinking; disabled -> enable_thinking false."""
    thinking = request.thinking
    if thinking is None:
        return {}
    if thinking.type == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": True}}
    if thinking.type == "enabled":
        budget = thinking.budget_tokens
        if budget is None:
            raise InvalidRequestError(
                'thinking.budget_tokens: required when thinking.type is "enabled".', "thinking"
            )
        max_tokens = getattr(request, "max_tokens", None)
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidRequestError(
                f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                f"({max_tokens}): the answer comes after the thinking.",
                "thinking",
            )
        fields["thinking_token_budget"] = budget
    return fields
