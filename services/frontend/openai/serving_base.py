"""What the completions and chat endpoints share: model names, prompt checks, the context
budget, running one HTTP request's engine requests, SSE framing and client disconnects.

One HTTP request may hold several engine requests (one per prompt, each with n sequences);
their delta outputs are merged into one stream of (prompt_index, RequestOutput). Leaving
that stream early — an error, a client that went away, a cancelled task — aborts every
engine request still running, so their KV blocks are freed in the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common.lora_request import LoRARequest
from services.common.outputs import RequestOutput
from services.common.request_options import DEFAULT_OPTIONS, RequestOptions
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.input_processor import ContextLengthExceededError
from services.frontend.metrics import FrontendMetrics, RequestMetrics
from services.frontend.openai.errors import InvalidRequestError, ModelNotFoundError, to_openai_error

logger = logging.getLogger(__name__)
T = TypeVar("T")
DONE_EVENT = "data: [DONE]\n\n"


class ClientDisconnectedError(Exception):
    """The HTTP client went away before its response was ready."""


@dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: list[int]

    def as_engine_prompt(self) -> dict:
        return {"prompt_token_ids": self.token_ids, "prompt": self.text}


@dataclass(frozen=True)
class Job:
    """One HTTP request's engine requests: its prompts, their params, its metrics."""

    request_id: str
    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]
    recorder: RequestMetrics
    options: RequestOptions = DEFAULT_OPTIONS  # its lora_request: the adapter `model` names

    @property
    def n(self) -> int:
        return self.params[0].n


class ChunkEnvelope:
    """A stream's constant chunk fields (id, object, created, model, null usage), serialised
    once: each chunk then serialises only its choices, and every chunk of the stream
    carries the same `created`, as OpenAI's do."""

    def __init__(self, empty_chunk) -> None:
        self.created = empty_chunk.created
        text = empty_chunk.model_dump_json()
        head, found, tail = text.partition('"choices":[]')
        assert found, text
        self._head, self._tail = head + '"choices":[', "]" + tail

    def json(self, choices: list) -> str:
        """The chunk's JSON: equal to the chunk model's model_dump_json()."""
        return self._head + ",".join(c.model_dump_json() for c in choices) + self._tail


class Tracker(Protocol):
    """Turns a job's delta outputs into an endpoint's chunks and final response."""

    envelope: ChunkEnvelope

    def prelude(self) -> list: ...

    def update(self, prompt_index: int, output: RequestOutput) -> list: ...

    def chunk(self, choices: list): ...

    def usage(self): ...

    def response(self): ...


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    return sse(json.dumps(to_openai_error(exc).body()))


class ServingBase:
    def __init__(self, frontend, served_model_names: list[str], metrics: FrontendMetrics) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must name at least one model.")
        self.frontend = frontend
        self.served_model_names = list(served_model_names)
        self.metrics = metrics

    @property
    def max_model_len(self) -> int:
        return self.frontend.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.frontend.info.vocab_size

    def check_model(self, model: str | None) -> str:
        """The served name or LoRA adapter a request addresses (the first served name
        when it names none)."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names and self.lora_of(model) is None:
            raise ModelNotFoundError(model)
        return model

    def lora_of(self, model: str) -> LoRARequest | None:
        """The adapter served under the name `model` (None: a base model name)."""
        if model in self.served_model_names:
            return None
        return self.frontend.input_processor.loras.get(model)

    @property
    def limits(self):
        return self.frontend.limits

    def check_prompt_size(self, prompt, param: str = "prompt") -> None:
        """Text by its bytes, token ids by their count: before any tokenizing."""
        if isinstance(prompt, str):
            self.limits.check_prompt_text(prompt, param)
        else:
            self.limits.check_token_ids(prompt, param)

    def process_prompt(self, prompt, add_special_tokens: bool, param: str) -> Prompt:
        """Tokenize and check a prompt (str or token ids); errors name `param`."""
        try:
            processed = self.frontend.input_processor.process(prompt, add_special_tokens)
        except ValueError as exc:
            code = getattr(exc, "code", None) or "invalid_value"
            raise InvalidRequestError(str(exc), param, code) from exc
        text = processed.prompt
        if text is None and self.frontend.tokenizer is not None:
            text = self.frontend.tokenizer.decode(processed.prompt_token_ids)
        return Prompt(text, processed.prompt_token_ids)

    def max_tokens(
        self, requested: int | None, prompt: Prompt, param: str, prompt_param: str = "prompt"
    ) -> int:
        """The completion budget: what the request asked for, within the context."""
        num_prompt = len(prompt.token_ids)
        room = self.max_model_len - num_prompt
        if requested is None:
            if room < 1:
                raise InvalidRequestError(
                    f"the prompt has {num_prompt} tokens and leaves no room to generate "
                    f"within the maximum context length of {self.max_model_len} tokens.",
                    prompt_param,
                    ContextLengthExceededError.code,
                )
            return min(room, self.frontend.default_sampling.get("max_tokens", room))
        if requested < 1:
            raise InvalidRequestError(f"{param} must be at least 1, got {requested}.", param)
        if requested > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                f"{requested} for the completion). Reduce the prompt or {param}.",
                param,
                ContextLengthExceededError.code,
            )
        return requested

    # ---- running a job -----------------------------------------------------------
    async def outputs(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt_index, delta output) pairs from every prompt, as they arrive.

        The queue holds one item per prompt at most: a reader that lags (a client that
        reads its SSE stream slowly) holds the pumps back, so the outputs wait merged in
        the Frontend's per-request queues, whose bound aborts a client that stopped."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(job.prompts))
        tasks = [
            asyncio.create_task(self._pump(job, i, prompt, params, queue))
            for i, (prompt, params) in enumerate(zip(job.prompts, job.params, strict=True))
        ]
        reasons: dict[tuple[int, int], str | None] = {}
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                self._observe(job, item, index, reasons)
                yield index, item
        finally:
            for task in tasks:
                task.cancel()  # no await: this may run inside a cancelled scope
            job.recorder.finish(
                reasons.get((i, j)) for i in range(len(job.prompts)) for j in range(job.n)
            )

    async def _pump(self, job: Job, index: int, prompt: Prompt, params, queue) -> None:
        request_id = f"{job.request_id}-{index}"
        params.output_kind = RequestOutputKind.DELTA
        try:
            stream = self.frontend.generate(
                prompt.as_engine_prompt(), params, request_id, job.options
            )
            async with contextlib.aclosing(stream):  # aborts it when cancelled mid-put
                async for output in stream:
                    await queue.put((index, output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    @staticmethod
    def _observe(job: Job, output: RequestOutput, index: int, reasons: dict) -> None:
        recorder = job.recorder
        if not any((index, j) in reasons for j in range(job.n)):
            recorder.on_prompt(len(output.prompt_token_ids), output.metrics.get("time_in_queue"))
        recorder.on_tokens(sum(len(o.token_ids) for o in output.outputs))
        for o in output.outputs:
            reasons[(index, o.index)] = o.finish_reason

    async def respond(
        self, raw_request: Request, job: Job, tracker: Tracker, stream: bool, include_usage: bool
    ) -> Response:
        """Run the job: an SSE stream, or one JSON body once every choice has finished."""
        return await self.run_job(
            raw_request,
            job,
            tracker,
            stream,
            lambda first, outputs: _events(tracker, first, outputs, include_usage),
            lambda: tracker.response().model_dump(),
        )

    async def run_job(self, raw_request: Request, job: Job, tracker, stream: bool, events, body):
        """Run the job for a client: `events(first, outputs)` as an SSE stream once the first
        output came, or `body()` as JSON once `tracker` has taken every output; a client
        gone before then is a 499 (its request aborted)."""
        outputs = self.outputs(job)
        try:
            if stream:
                first = await self.until_disconnected(raw_request, first_output(outputs))
                return StreamingResponse(events(first, outputs), media_type="text/event-stream")
            await self.until_disconnected(raw_request, collect_outputs(tracker, outputs))
        except ClientDisconnectedError:
            return Response(status_code=499)
        return JSONResponse(body())

    # ---- client disconnects ------------------------------------------------------
    @staticmethod
    async def until_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
        """Await `work`, cancelling it (and raising ClientDisconnectedError) if the client
        goes away first."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnectedError()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def first_output(outputs: AsyncIterator[T]) -> T:
    """The first output (so admission errors surface before any response is sent)."""
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        raise RuntimeError("the engine ended the request without any output") from None


async def collect_outputs(tracker: Tracker, outputs) -> None:
    async with contextlib.aclosing(outputs):
        async for index, output in outputs:
            tracker.update(index, output)


async def _events(tracker: Tracker, first, outputs, include_usage: bool):
    """SSE chunks, then a usage chunk if asked for, then [DONE]; a failure mid-stream is
    sent as an error event (the status line is long gone)."""
    async with contextlib.aclosing(outputs):
        try:
            envelope = tracker.envelope
            for chunk in tracker.prelude():
                yield sse(chunk.model_dump_json())
            for choice in tracker.update(*first):
                yield sse(envelope.json([choice]))
            async for index, output in outputs:
                for choice in tracker.update(index, output):
                    yield sse(envelope.json([choice]))
            if include_usage:
                final = tracker.chunk([])
                final.usage = tracker.usage()
                yield sse(final.model_dump_json())
        except Exception as exc:
            logger.warning("stream failed: %s", exc)
            yield sse_error(exc)
    yield DONE_EVENT
