"""POST /v1/completions: prompts (text or token ids, one or many) -> completions, streamed
as SSE or returned whole. Choices are indexed prompt_index * n + j, as OpenAI does."""

from __future__ import annotations

import dataclasses

from fastapi import Request

from services.common.outputs import CompletionOutput, RequestOutput
from services.common.request_options import RequestOptions
from services.frontend.openai.logprobs import CompletionLogprobsBuilder
from services.frontend.openai.protocol import CompletionRequest
from services.frontend.openai.replies import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from services.frontend.openai.serving_base import ChunkEnvelope, Job, Prompt, ServingBase


class _Choice:
    """One choice's text and logprobs so far, and whether its finish was sent."""

    def __init__(
        self, index: int, prompt: Prompt, echo: bool, builder, *, score_only: bool = False
    ) -> None:
        self.index = index
        self.prompt = prompt
        self.echo = echo
        # echo with max_tokens=0 scores the prompt: the one token the engine generates
        # (it always generates at least one) is not part of the choice.
        self.score_only = score_only
        self.builder = builder  # CompletionLogprobsBuilder, or None without logprobs
        self.started = False
        self.finish_sent = False
        self.num_tokens = 0
        self.text = ""
        self.logprobs = CompletionLogProbs() if builder is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def update(self, output, prompt_logprobs) -> list[CompletionChoice]:
        """Apply one delta; returns the stream chunks' choices: the new text (finish_reason
        null), then, when it ends, the finish_reason with no text (as OpenAI streams)."""
        if self.score_only:
            output = _without_generation(output)
        text, logprobs = output.text, None
        if self.builder is not None:
            logprobs = CompletionLogProbs()
            if self.echo and not self.started:
                positions = prompt_logprobs or [None] * len(self.prompt.token_ids)
                _extend(logprobs, self.builder.build(self.prompt.token_ids, positions))
            _extend(logprobs, self.builder.build(output.token_ids, output.logprobs or []))
            _extend(self.logprobs, logprobs)
        if self.echo and not self.started:
            text = (self.prompt.text or "") + text
        self.started = True
        self.num_tokens += len(output.token_ids)
        self.text += text
        finish = None
        if output.finish_reason is not None and not self.finish_sent:
            finish, self.finish_sent = output.finish_reason, True
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        choices = []  # no text: tokens still held back (a partial character)
        if text or (logprobs is not None and output.token_ids):
            choices.append(CompletionChoice(index=self.index, text=text, logprobs=logprobs))
        if finish is not None:
            choices.append(
                CompletionChoice(
                    index=self.index, text="", finish_reason=finish, stop_reason=self.stop_reason
                )
            )
        return choices

    def final(self) -> CompletionChoice:
        return CompletionChoice(
            index=self.index,
            text=self.text,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or "abort",
            stop_reason=self.stop_reason,
        )


def _without_generation(output: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(output, text="", token_ids=[], logprobs=None)


def _extend(into: CompletionLogProbs, more: CompletionLogProbs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


class _CompletionTracker:
    def __init__(self, request: CompletionRequest, job: Job, tokenizer) -> None:
        self.job = job
        n = job.n
        self.choices = [
            _Choice(
                i * n + j,
                prompt,
                request.echo,
                CompletionLogprobsBuilder(tokenizer) if request.logprobs is not None else None,
                score_only=request.scores_prompt_only,
            )
            for i, prompt in enumerate(job.prompts)
            for j in range(n)
        ]
        self.cached_tokens = [0] * len(job.prompts)
        empty = CompletionResponse(id=job.request_id, model=job.model, choices=[])
        self.envelope = ChunkEnvelope(empty)

    def update(self, prompt_index: int, output: RequestOutput) -> list[CompletionChoice]:
        self.cached_tokens[prompt_index] = max(
            self.cached_tokens[prompt_index], output.num_cached_tokens
        )
        updates = []
        for o in output.outputs:
            choice = self.choices[prompt_index * self.job.n + o.index]
            updates += choice.update(o, output.prompt_logprobs)
        return updates

    def prelude(self) -> list:
        return []

    def usage(self) -> UsageInfo:
        return UsageInfo.of(
            sum(len(p.token_ids) for p in self.job.prompts),
            sum(c.num_tokens for c in self.choices),
            sum(self.cached_tokens),
        )

    def chunk(self, choices: list[CompletionChoice]) -> CompletionResponse:
        created = self.envelope.created
        return CompletionResponse(
            id=self.job.request_id, created=created, model=self.job.model, choices=choices
        )

    def response(self) -> CompletionResponse:
        return CompletionResponse(
            id=self.job.request_id,
            model=self.job.model,
            choices=[c.final() for c in self.choices],
            usage=self.usage(),
        )


class OpenAIServingCompletion(ServingBase):
    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        model = self.check_model(request.model)
        request.check()
        job = self._job(request, model)
        tracker = _CompletionTracker(request, job, self.frontend.tokenizer)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return await self.respond(raw_request, job, tracker, request.stream, include_usage)

    def _job(self, request: CompletionRequest, model: str) -> Job:
        self._check_limits(request)
        prompts = [
            self.process_prompt(p, request.add_special_tokens, "prompt") for p in request.prompts()
        ]
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = request.logprobs
        constraint = request.structured_outputs_params()
        params = [
            request.to_sampling_params(
                self.max_tokens(
                    1 if request.scores_prompt_only else request.max_tokens, p, "max_tokens"
                ),
                self.vocab_size,
                logprobs=request.logprobs,
                prompt_logprobs=prompt_logprobs,
                defaults=self.frontend.default_sampling,
                structured_outputs=constraint,
            )
            for p in prompts
        ]
        return Job(
            request_id=random_id("cmpl"),
            model=model,
            prompts=prompts,
            params=params,
            recorder=self.metrics.start_request(),
            options=RequestOptions(
                priority=request.priority,
                cache_salt=request.cache_salt,
                lora_request=self.lora_of(model),
            ),
        )

    def _check_limits(self, request: CompletionRequest) -> None:
        """The frontend's limits, before any prompt is tokenized."""
        prompts = request.prompts()
        self.limits.check_n(request.n)
        self.limits.check_prompts(len(prompts), request.n)
        for prompt in prompts:
            self.check_prompt_size(prompt)
        if not request.scores_prompt_only:
            self.limits.check_max_tokens(request.max_tokens)
