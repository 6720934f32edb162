"""The Responses API's request body (POST /v1/responses), and what it means as a chat
request: the Responses API runs the same chat template, tool plan and SamplingParams as
/v1/chat/completions (serving_responses.py), so the request turns itself into one. What
this server cannot honour is a 400 naming the field, never silently dropped
(ResponsesRequest lists what is refused and what is accepted as a no-op).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.sampling_params import MAX_LOGPROBS
from services.common.structured_outputs import StructuredOutputsParams, check_grammar
from services.frontend.openai.chat_messages import (
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
)
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.protocol import ChatCompletionRequest
from services.frontend.openai.structured_request import (
    JsonSchemaFormat,
    ResponseFormat,
    response_format_params,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's other include values: nothing here produces what they add (no reasoning items,
# no built-in tools, no images), so asking for them changes nothing.
NO_OP_INCLUDES = (
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
)
TOOL_CHOICES = ("auto", "none", "required")
MAX_METADATA = (16, 64, 512)  # OpenAI's: keys, key length, value length


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)


class FunctionTool(_Model):
    type: Literal["function"] = "function"
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> ChatTool:
        fields = self.model_dump(exclude={"type"}, exclude_none=True)
        return ChatTool(function=FunctionDefinition(**fields))


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not steered


class ResponsesRequest(_Model):
    """Function tools are flat here (`{type: "function", name, parameters, ...}`) and become
    the chat endpoint's `{type: "function", function: {...}}`; `text.format` is the chat
    endpoint's `response_format`. What this server cannot honour is a 400 naming the field,
    never silently dropped: tools other than functions, background mode, stored prompts and
    conversations, unknown `include` values. What agent tooling sends for every model and
    that does not change the answer of a model without a reasoning mode is accepted as a no-op:
    `reasoning` (effort, summary), `truncation` "auto" (a conversation over the context is
    still a 400), `include` values for reasoning items or built-in tools (none are produced),
    `max_tool_calls` (it bounds built-in tools only) and `text.verbosity`.
    """

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    # refused unless unset (or the default): see check()
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    # accepted as no-ops (see the module's docstring)
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    # vLLM's sampling extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None

    def check(self) -> None:
        """Refuse what this server cannot honour (400 naming the field)."""
        if self.background:
            _unsupported("background", "background mode is not supported; leave it false.")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                _unsupported(name, f"{name} is not supported by this server.")
        for item in self.include or []:
            if item != LOGPROBS_INCLUDE and item not in NO_OP_INCLUDES:
                _unsupported("include", f"include {item!r} is not one of OpenAI's values.")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}.",
                "top_logprobs",
            )
        self._check_metadata()

    def _check_metadata(self) -> None:
        keys, key_len, value_len = MAX_METADATA
        metadata = self.metadata or {}
        if len(metadata) > keys:
            raise InvalidRequestError(f"metadata has more than {keys} keys.", "metadata")
        for key, value in metadata.items():
            if len(key) > key_len or len(value) > value_len:
                raise InvalidRequestError(
                    f"metadata keys are at most {key_len} characters and values at most "
                    f"{value_len}; {key[:key_len]!r} is over.",
                    "metadata",
                )

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or [])

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise InvalidRequestError(
                    f"tools[{i}].type {kind!r} is not supported: this server runs function "
                    "tools only (no built-in tools such as web_search or file_search).",
                    f"tools[{i}].type",
                )
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(f"{p}" for p in (f"tools[{i}]", *first["loc"]))
                raise InvalidRequestError(f"{where}: {first['msg']}", where) from None
        return tools

    def chat_tool_choice(self):
        """tool_choice in the chat endpoint's terms."""
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                f'tool_choice must be one of {", ".join(TOOL_CHOICES)} or {{"type": "function", '
                f'"name": ...}}; got {choice!r}.',
                "tool_choice",
            )
        return NamedToolChoice(function=FunctionName(name=name))

    @property
    def _default_choice(self) -> bool:
        """tool_choice auto or none (or none given) with no tools: no tools, as OpenAI
        reads it."""
        return self.tool_choice in (None, "auto", "none")

    def echoed_tool_choice(self, has_tools: bool) -> str | dict:
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "name": self.tool_choice.get("name")}
        return self.tool_choice or ("auto" if has_tools else "none")

    def constraint(self) -> StructuredOutputsParams | None:
        """text.format as a structured-output constraint (compiled here to check it)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_schema" and (fmt.name is None or fmt.json_schema is None):
            raise InvalidRequestError(
                "text.format of type json_schema needs a name and a schema.", "text.format"
            )
        schema = JsonSchemaFormat(name=fmt.name, schema=fmt.json_schema, strict=fmt.strict)
        try:
            params = response_format_params(ResponseFormat(type=fmt.type, json_schema=schema))
            check_grammar(params)
        except ValueError as exc:
            raise InvalidRequestError(f"text.format: {exc}", "text.format") from exc
        return params

    def chat_request(self, messages: list[ChatMessage], tools: list[FunctionTool]):
        """The chat request that runs this one (its conversation: `messages`)."""
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            tools=[t.as_chat_tool() for t in tools] or None,
            tool_choice=self.chat_tool_choice() if tools or not self._default_choice else None,
            parallel_tool_calls=self.parallel_tool_calls,
            logprobs=self.wants_logprobs,
            top_logprobs=self.top_logprobs if self.wants_logprobs else None,
            user=self.user,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            priority=self.priority,
            cache_salt=self.cache_salt,
        )

    def echoed_text(self) -> dict:
        """`text` as the response reports it."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return {"format": {"type": "text"}}
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def _unsupported(param: str, message: str) -> None:
    raise InvalidRequestError(message, param)
