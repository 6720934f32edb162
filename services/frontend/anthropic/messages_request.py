"""The Anthropic Messages request body (POST /v1/messages and /v1/messages/count_tokens).

Pydantic models of Anthropic's field names; unknown fields are ignored (clients send
beta fields this server has no use for), as the OpenAI request models do. Content blocks
are told apart by `type`; blocks this server cannot serve (documents, images outside a
user's turn) parse, so the conversion (chat_request.py) can refuse them with a message
that names the block.
Sizes are bounded where the chat endpoint bounds them: the body's bytes (middleware),
then the converted conversation's messages and text, tools, stops (build_job).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ImageBlock(_Model):
    """An image (its source: {"type": "base64", "media_type", "data"} or {"type": "url",
    "url"}), or a document, which is refused by name."""

    type: Literal["image", "document"]
    source: dict | None = None


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(_Model):
    """The model's earlier thinking, sent back in an assistant turn (its signature is this
    server's empty one, or another server's: not checked)."""

    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(_Model):
    """Thinking another server encrypted: nothing a template could read (dropped)."""

    type: Literal["redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]


class Tool(_Model):
    """A client tool. `type` is absent or "custom"; Anthropic's server tools (web search,
    code execution, ...) have other types and are refused by name."""

    type: str | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Model):
    """enabled: think, for at most budget_tokens tokens; adaptive: think, the model decides
    how long; disabled: answer directly."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class MessagesRequest(_Model):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted; its user_id is not used
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CountTokensRequest(_Model):
    """count_tokens takes the conversation without max_tokens or sampling."""

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
