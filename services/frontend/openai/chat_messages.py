"""Chat request messages and tool definitions (OpenAI's shapes) and the dicts the chat
template sees.

Assistant messages may carry `tool_calls` and `tool` messages carry a `tool_call_id`, so a
client can send a conversation back with the tool results. An assistant call's
`arguments` (a JSON string on the wire) is given to the template as an object, as Hugging
Face templates expect (vLLM does the same); arguments that are not JSON are a 400.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from services.frontend.openai.exceptions import InvalidRequestError


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Model):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ImageURL(_Model):
    url: str
    detail: str | None = None  # OpenAI's; the model's processor decides the resolution


class ContentPart(_Model):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None  # an image_url part (an object, or the bare URL)


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_Model):
    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # An assistant turn's thinking, as a reply carried it (either name): templates that
    # keep the thinking of an agent's ongoing turn (Qwen3's) read `reasoning_content`.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @property
    def has_tool_parts(self) -> bool:
        return bool(self.tool_calls) or self.role == "tool"

    def as_template_message(self, index: int = 0) -> dict:
        """The dict the chat template sees (content parts stay parts; the template helper
        joins them and rejects non-text ones; chat_images.split_images takes the images)."""
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None and self.role == "assistant":
            message["reasoning_content"] = thinking
        if self.tool_calls:
            message["tool_calls"] = [
                _template_call(call, f"messages[{index}].tool_calls[{j}]")
                for j, call in enumerate(self.tool_calls)
            ]
        return message

    def text(self) -> str:
        """All its text (limits count it): content parts joined, then call arguments."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        calls = "".join(c.function.name + c.function.arguments for c in self.tool_calls or [])
        thinking = (self.reasoning_content or "") + (self.reasoning or "")
        return (content or "") + calls + thinking


def _template_call(call: ToolCallIn, where: str) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"{where}.function.arguments is not valid JSON: {exc}", "messages"
        ) from exc
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out
