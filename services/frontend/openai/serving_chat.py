"""POST /v1/chat/completions: messages through the chat template -> assistant replies.

Streaming sends, per choice, a first chunk with role "assistant", then content deltas,
then the choice's finish_reason; with include_usage a last chunk with no choices.
"""

from __future__ import annotations

import jinja2
from fastapi import Request

from services.common.outputs import RequestOutput
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.logprobs import chat_logprobs
from services.frontend.openai.protocol import ChatCompletionRequest, ChatMessage
from services.frontend.openai.responses import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from services.frontend.openai.serving_base import Job, ServingBase
from services.frontend.tokenizer import apply_chat_template


def render_chat(
    tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, chat_template
) -> str:
    """The conversation as prompt text; template problems are the request's (400)."""
    if tokenizer is None:
        raise InvalidRequestError("chat needs a tokenizer, and this model has none.", "messages")
    try:
        return apply_chat_template(
            tokenizer,
            [m.as_template_message() for m in messages],
            add_generation_prompt,
            chat_template,
        )
    except jinja2.TemplateError as exc:
        param = "chat_template" if chat_template is not None else "messages"
        raise InvalidRequestError(f"the chat template failed: {exc}", param) from exc
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "messages") from exc


_ROLE = DeltaMessage(role="assistant", content="")


class _ChatChoice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.content = ""
        self.num_tokens = 0
        self.logprobs: list | None = None
        self.finish_sent = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class _ChatTracker:
    def __init__(self, request: ChatCompletionRequest, job: Job, tokenizer) -> None:
        self.job = job
        self.tokenizer = tokenizer
        self.num_logprobs = request.num_logprobs
        self.choices = [_ChatChoice(i) for i in range(job.n)]
        self.cached_tokens = 0

    def update(self, prompt_index: int, output: RequestOutput) -> list[ChatStreamChoice]:
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        updates = []
        for o in output.outputs:
            choice = self.choices[o.index]
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
                choice.finish_reason, choice.stop_reason = o.finish_reason, o.stop_reason
            if o.text or finish is not None or (logprobs is not None and o.token_ids):
                updates.append(
                    ChatStreamChoice(
                        index=choice.index,
                        delta=DeltaMessage(content=o.text),
                        logprobs=logprobs,
                        finish_reason=finish,
                        stop_reason=choice.stop_reason if finish else None,
                    )
                )
        return updates

    def usage(self) -> UsageInfo:
        completion = sum(c.num_tokens for c in self.choices)
        return UsageInfo.of(len(self.job.prompts[0].token_ids), completion, self.cached_tokens)

    def chunk(self, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.job.request_id, model=self.job.model, choices=choices)

    def prelude(self) -> list[ChatCompletionChunk]:
        """The first chunk of every choice: the assistant's role."""
        return [self.chunk([ChatStreamChoice(index=c.index, delta=_ROLE)]) for c in self.choices]

    def response(self) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatMessageOut(content=c.content),
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
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        model = self.check_model(request.model)
        request.check()
        job = self._job(request, model)
        tracker = _ChatTracker(request, job, self.frontend.tokenizer)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return await self.respond(raw_request, job, tracker, request.stream, include_usage)

    def _job(self, request: ChatCompletionRequest, model: str) -> Job:
        self._check_limits(request)
        text = render_chat(
            self.frontend.tokenizer,
            request.messages,
            request.add_generation_prompt,
            request.chat_template,
        )
        prompt = self.process_prompt(text, request.add_special_tokens, "messages")
        param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        params = request.to_sampling_params(
            self.max_tokens(request.requested_max_tokens, prompt, param, "messages"),
            self.vocab_size,
            logprobs=request.num_logprobs,
            defaults=self.frontend.default_sampling,
        )
        return Job(
            request_id=random_id("chatcmpl"),
            model=model,
            prompts=[prompt],
            params=[params],
            recorder=self.metrics.start_request(),
            priority=request.priority,
            cache_salt=request.cache_salt,
        )

    def _check_limits(self, request: ChatCompletionRequest) -> None:
        """The frontend's limits, before the chat template or the tokenizer runs."""
        self.limits.check_messages([message_text(m) for m in request.messages])
        self.limits.check_n(request.n)
        param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        self.limits.check_max_tokens(request.requested_max_tokens, param)


def message_text(message: ChatMessage) -> str:
    """A message's text (its text parts joined), as far as limits are concerned."""
    content = message.content
    if isinstance(content, list):
        return "".join(part.text or "" for part in content)
    return content or ""
