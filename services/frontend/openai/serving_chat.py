"""POST /v1/chat/completions: messages through the chat template -> assistant replies.

With a reasoning parser (--reasoning-parser) or tools (tool_choice.py), each choice's text
goes through a ReplyParser: thinking (reasoning_content), content and tool-call deltas in
the stream, the same fields in the message, built from the same parsed deltas so both
agree. A reasoning model's grammar applies to its answer only, and thinking_token_budget
ends its thinking (the engine learns where thinking ends from ReasoningBounds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from services.common.image_input import ImageInput
from services.common.outputs import RequestOutput
from services.common.request_options import RequestOptions
from services.common.structured_outputs import StructuredOutputsParams
from services.frontend.chat_templates import template_for_tools
from services.frontend.multimodal.image_prompt import process_image_prompt
from services.frontend.openai.chat_messages import ChatMessage
from services.frontend.openai.chat_rendering import render_chat, render_chat_images
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.logprobs import chat_logprobs
from services.frontend.openai.protocol import ChatCompletionRequest
from services.frontend.openai.replies import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionTokensDetails,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from services.frontend.openai.serving_base import ChunkEnvelope, Job, Prompt, ServingBase
from services.frontend.openai.tool_call_output import delta_message, finish_reason, message_out
from services.frontend.openai.tool_choice import ToolPlan, plan_tools
from services.frontend.reasoning.engine_bounds import bound_reasoning
from services.frontend.reply_parser import ReplyParser
from services.frontend.tool_options import ToolServerOptions
from services.frontend.tool_parsers import ParsedDelta, ToolCallDelta, assemble

__all__ = ["ChatFields", "ChatTracker", "OpenAIServingChat", "message_text", "render_chat"]


_ROLE = DeltaMessage(role="assistant", content="")


@dataclass(frozen=True)
class ChatFields:
    """What a chat-shaped request calls its conversation and its token budget on the wire
    (errors name them): the chat endpoint's, or the Responses API's "input" and
    "max_output_tokens". max_tokens None: max_tokens or max_completion_tokens, as given."""

    messages: str = "messages"
    max_tokens: str | None = None

    def max_tokens_param(self, request: ChatCompletionRequest) -> str:
        if self.max_tokens is not None:
            return self.max_tokens
        return "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"


CHAT_FIELDS = ChatFields()


@dataclass(frozen=True)
class ImagePrompt(Prompt):
    """A chat prompt with images: its ids hold each image's expanded tokens."""

    images: tuple[ImageInput, ...] = ()

    def as_engine_prompt(self) -> dict:
        return {**super().as_engine_prompt(), "images": self.images}


class _ChatChoice:
    def __init__(self, index: int, reply: ReplyParser) -> None:
        self.index = index
        # None: the text is the content as it comes (no reasoning parser, no tools)
        self.reply = reply if reply.reasoning or reply.tools else None
        # What the parsed deltas add up to (kept as text, not as one object per token)
        self.thought = ""
        self.answer = ""
        self.call_pieces: list[ToolCallDelta] = []
        self.content = ""
        self.num_tokens = 0
        self.num_reasoning_tokens = 0  # tokens of deltas that were all thinking
        self.logprobs: list | None = None
        self.finish_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class ChatTracker:
    """One chat-shaped request's choices: their text, tool-call deltas, logprobs and usage
    (the Responses API reads the same deltas, serving_responses.py)."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        job: Job,
        tokenizer,
        new_reply: Callable[[], ReplyParser],
    ) -> None:
        """`new_reply`: a fresh ReplyParser for each choice (OpenAIServingChat.reply_parser)."""
        self.job = job
        self.tokenizer = tokenizer
        self.num_logprobs = request.num_logprobs
        self.include_reasoning = request.include_reasoning
        self.choices = [_ChatChoice(i, new_reply()) for i in range(job.n)]
        self.cached_tokens = 0
        empty = ChatCompletionChunk(id=job.request_id, model=job.model, choices=[])
        self.envelope = ChunkEnvelope(empty)

    def update(self, prompt_index: int, output: RequestOutput) -> list[ChatStreamChoice]:
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        updates = []
        for o in output.outputs:
            choice = self.choices[o.index]
            if choice.reply is None:  # else the parser keeps the split text
                choice.content += o.text
            choice.num_tokens += len(o.token_ids)
            logprobs = None
            if self.num_logprobs is not None:
                entries = chat_logprobs(
                    o.token_ids, o.logprobs or [], self.num_logprobs, self.tokenizer
                )
                choice.logprobs = (choice.logprobs or []) + entries
                logprobs = ChatChoiceLogprobs(content=entries)
            finish = None
            if o.finish_reason is not None and not choice.finish_sent:
                finish, choice.finish_sent = o.finish_reason, True
                choice.stop_reason = o.stop_reason
            delta, has_delta = self._delta(choice, o.text, finish is not None, len(o.token_ids))
            if finish is not None:
                num_calls = choice.reply.num_calls if choice.reply is not None else 0
                finish = choice.finish_reason = finish_reason(finish, num_calls)
            if has_delta or (logprobs is not None and o.token_ids):
                updates.append(ChatStreamChoice(index=choice.index, delta=delta, logprobs=logprobs))
            if finish is not None:  # its own chunk, after the last text
                updates.append(
                    ChatStreamChoice(
                        index=choice.index,
                        delta=DeltaMessage(),
                        finish_reason=finish,
                        stop_reason=choice.stop_reason,
                    )
                )
        return updates

    def _delta(
        self, choice: _ChatChoice, text: str, finished: bool, num_tokens: int
    ) -> tuple[DeltaMessage, bool]:
        """The stream delta for new text: as is, or through the choice's ReplyParser."""
        if choice.reply is None:
            return DeltaMessage(content=text), bool(text)
        parsed = choice.reply.feed(text, finished)
        answered = parsed.content or parsed.tool_calls
        if choice.reply.thinking or (parsed.reasoning and not answered):
            choice.num_reasoning_tokens += num_tokens
        if not self.include_reasoning:
            parsed.reasoning = ""
        choice.thought += parsed.reasoning
        choice.answer += parsed.content
        choice.call_pieces += parsed.tool_calls
        return delta_message(parsed), bool(parsed)

    def _message(self, choice: _ChatChoice) -> ChatMessageOut:
        if choice.reply is None:
            return ChatMessageOut(content=choice.content)
        whole = ParsedDelta(content=choice.answer, tool_calls=choice.call_pieces)
        return message_out(assemble([whole])).with_reasoning(choice.thought or None)

    def usage(self) -> UsageInfo:
        completion = sum(c.num_tokens for c in self.choices)
        usage = UsageInfo.of(len(self.job.prompts[0].token_ids), completion, self.cached_tokens)
        reasoning = sum(c.num_reasoning_tokens for c in self.choices)
        if reasoning:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning)
        return usage

    def chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        created = self.envelope.created
        return ChatCompletionChunk(
            id=self.job.request_id, created=created, model=self.job.model, choices=choices
        )

    def prelude(self) -> list[ChatCompletionChunk]:
        """The first chunk of every choice: the assistant's role."""
        return [self.chunk([ChatStreamChoice(index=c.index, delta=_ROLE)]) for c in self.choices]

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=c.index,
                message=self._message(c),
                logprobs=None if c.logprobs is None else ChatChoiceLogprobs(content=c.logprobs),
                finish_reason=c.finish_reason or "abort",
                stop_reason=c.stop_reason,
            )
            for c in self.choices
        ]
        return ChatCompletionResponse(
            id=self.job.request_id, model=self.job.model, choices=choices, usage=self.usage()
        )


class OpenAIServingChat(ServingBase):
    """Streaming sends, per choice, a first chunk with role "assistant", then content deltas
    (finish_reason null), then a chunk with an empty delta and the choice's finish_reason,
    as OpenAI does (clients that collect text while finish_reason is null keep the last
    token); with include_usage a last chunk with no choices."""

    def __init__(self, *args, tool_options: ToolServerOptions | None = None) -> None:
        super().__init__(*args)
        options = tool_options or ToolServerOptions()
        # Without --tool-call-parser, the format taught by the template that requests with
        # tools render with (detect.py): the shipped ChatML's hermes where it stands in.
        self.tool_options = options.for_template(_tools_template(self.frontend.tokenizer, options))

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        model = self.check_model(request.model)
        request.check()
        self.limits.check_tools(request.tools)  # before a grammar is built from them
        plan = plan_tools(request, self.tool_options)
        job = await self.build_job(request, model, plan, random_id("chatcmpl"))
        tracker = ChatTracker(
            request, job, self.frontend.tokenizer, lambda: self.reply_parser(plan, job)
        )
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return await self.respond(raw_request, job, tracker, request.stream, include_usage)

    async def build_job(
        self,
        request: ChatCompletionRequest,
        model: str,
        plan: ToolPlan,
        request_id: str,
        fields: ChatFields = CHAT_FIELDS,
        constraint: StructuredOutputsParams | None = None,
    ) -> Job:
        """The engine job of a chat-shaped request: the limits, the chat template with the
        plan's tools, the prompt, its SamplingParams. The Responses API runs its requests
        through here too; `constraint` is a structured-output constraint it built itself
        (else the request's own)."""
        self._check_limits(request, fields)
        text, images = await render_chat_images(
            self.frontend,
            request.messages,
            request.add_generation_prompt,
            request.chat_template,
            self.tool_options.chat_template,
            plan.template_tools,
            param=fields.messages,
            template_kwargs=_template_kwargs(request),
        )
        if images:
            prompt = await self.image_prompt(text, images, request.add_special_tokens, fields)
        else:
            prompt = self.process_prompt(text, request.add_special_tokens, fields.messages)
        param = fields.max_tokens_param(request)
        params = request.to_sampling_params(
            self.max_tokens(request.requested_max_tokens, prompt, param, fields.messages),
            self.vocab_size,
            logprobs=request.num_logprobs,
            defaults=self.frontend.default_sampling,
            structured_outputs=_constraint(request, plan, constraint),
        )
        if plan.parser is not None:
            params.skip_special_tokens = plan.parser.skip_special_tokens
        params.thinking_token_budget = request.thinking_token_budget
        try:
            bound_reasoning(
                params, self.frontend.reasoning_parser, self.frontend.tokenizer, prompt.text or ""
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "thinking_token_budget") from exc
        return Job(
            request_id=request_id,
            model=model,
            prompts=[prompt],
            params=[params],
            recorder=self.metrics.start_request(),
            options=RequestOptions(
                priority=request.priority,
                cache_salt=request.cache_salt,
                lora_request=self.lora_of(model),
            ),
        )

    async def image_prompt(
        self, text: str, images: list, add_special_tokens: bool, fields: ChatFields
    ) -> ImagePrompt:
        """The prompt with its images loaded, decoded and expanded by the model's processor
        (process_image_prompt)."""
        try:
            processed = await process_image_prompt(self.frontend, text, images, add_special_tokens)
        except ValueError as exc:
            code = getattr(exc, "code", None) or "invalid_value"
            raise InvalidRequestError(str(exc), fields.messages, code) from exc
        return ImagePrompt(text, processed.prompt_token_ids, processed.images)

    def reply_parser(self, plan: ToolPlan, job: Job) -> ReplyParser:
        """A fresh parser for one choice of `job`: its thinking (with a reasoning parser,
        starting where the prompt's end says), then tool calls in its answer."""
        reasoning = self.frontend.reasoning_parser
        prompt = job.prompts[0].text or ""
        return ReplyParser(
            reasoning.stream(prompt) if reasoning is not None else None,
            plan.parser.stream() if plan.parser is not None else None,
        )

    def _check_limits(self, request: ChatCompletionRequest, fields: ChatFields) -> None:
        """The frontend's limits, before the chat template or the tokenizer runs."""
        self.limits.check_messages([message_text(m) for m in request.messages], fields.messages)
        self.limits.check_n(request.n)
        self.limits.check_max_tokens(request.requested_max_tokens, fields.max_tokens_param(request))


def _constraint(
    request: ChatCompletionRequest, plan: ToolPlan, own: StructuredOutputsParams | None = None
):
    """The request's structured-output constraint, or the tool-call grammar; not both."""
    if own is None:
        own = request.structured_outputs_params()
    if plan.constraint is None:
        return own
    if own is not None:
        raise InvalidRequestError(
            "tool_choice 'required' or a named function constrains the output to tool calls; "
            "it cannot be combined with response_format (text.format), structured_outputs or "
            "guided_*.",
            "tool_choice",
        )
    return plan.constraint


def _tools_template(tokenizer, options: ToolServerOptions) -> str | None:
    """The text of the template a request with tools renders with (None: no tokenizer)."""
    if tokenizer is None:
        return None
    template = template_for_tools(tokenizer, options.chat_template) or tokenizer.chat_template
    if isinstance(template, dict):  # named templates: the one for tools, else the default
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def _template_kwargs(request: ChatCompletionRequest) -> dict | None:
    """The request's chat_template_kwargs, with OpenAI's reasoning_effort among them."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    return kwargs or None


def message_text(message: ChatMessage) -> str:
    """A message's text (its text parts joined), as far as limits are concerned."""
    return message.text()
