"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API.

A request becomes the chat request it means (responses_request.py: instructions, the
previous response's conversation without its instructions, then the input items) and runs
the chat endpoint's own path (template, tool plan, SamplingParams, ChatTracker), so under
greedy decoding its text is the chat completion's for the same conversation. A finished
response is stored (store, default true) in the bounded ResponseStore.
"""

from __future__ import annotations

import contextlib
import json
import logging

from fastapi import Request

from services.common.outputs import RequestOutput
from services.frontend.openai.chat_messages import ChatMessage, FunctionCallIn, ToolCallIn
from services.frontend.openai.errors import to_openai_error
from services.frontend.openai.exceptions import InvalidRequestError, ResponseNotFoundError
from services.frontend.openai.response_input import input_items, input_messages, output_message
from services.frontend.openai.response_object import (
    FunctionCallOutputItem,
    IncompleteDetails,
    OutputMessage,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    new_id,
)
from services.frontend.openai.response_output_builder import ResponseOutputBuilder
from services.frontend.openai.response_store import ResponseStore
from services.frontend.openai.responses_request import ResponsesRequest
from services.frontend.openai.serving_base import (
    Job,
    ServingBase,
)
from services.frontend.openai.serving_chat import ChatFields, ChatTracker, OpenAIServingChat
from services.frontend.openai.tool_choice import plan_tools

logger = logging.getLogger(__name__)
RESPONSES_FIELDS = ChatFields(messages="input", max_tokens="max_output_tokens")


class _ResponseRun:
    """One response being made: the chat tracker's deltas into output items and events."""

    def __init__(self, response: ResponseObject, job: Job, tracker: ChatTracker, history, items=()):
        self.response = response
        self.input_items: list[dict] = list(items)  # the request's own input, as items
        self.job = job
        self.tracker = tracker
        self.builder = ResponseOutputBuilder()
        self.conversation: list[ChatMessage] = history  # without instructions
        self.finish_reason: str | None = None

    def update(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        events = []
        for choice in self.tracker.update(prompt_index, output):
            logprobs = choice.logprobs.content if choice.logprobs is not None else None
            events += self.builder.feed(choice.delta, logprobs)
            self.finish_reason = choice.finish_reason or self.finish_reason
        return events

    def finish(self) -> list[dict]:
        """Close the output; the response is then complete (or incomplete)."""
        incomplete = self.finish_reason in (None, "length", "abort")
        events = self.builder.finish("incomplete" if incomplete else "completed")
        response = self.response
        response.output = self.builder.items
        response.status = "incomplete" if incomplete else "completed"
        if self.finish_reason == "length":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        elif incomplete:
            response.incomplete_details = IncompleteDetails()
        usage = self.tracker.usage()
        details = usage.completion_tokens_details
        response.usage = ResponseUsage.of(
            usage.prompt_tokens,
            usage.completion_tokens,
            self.tracker.cached_tokens,
            details.reasoning_tokens if details is not None else 0,
        )
        return events

    def fail(self, exc: BaseException) -> None:
        self.response.status = "failed"
        self.response.output = self.builder.items
        error = to_openai_error(exc)  # the message a chat stream's error event would carry
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        self.response.error = ResponseError(code=code, message=error.message)

    def full_conversation(self) -> list[ChatMessage]:
        """The conversation a follow-up continues: the input, then this output."""
        text, calls = [], []
        for item in self.builder.items:
            if isinstance(item, OutputMessage):
                text.append(item.content[0].text)
            elif isinstance(item, FunctionCallOutputItem):
                function = FunctionCallIn(name=item.name, arguments=item.arguments)
                calls.append(ToolCallIn(id=item.call_id, function=function))
        content = "".join(text) if text or not calls else None
        return [*self.conversation, output_message(content, calls)]


class OpenAIServingResponses(ServingBase):
    """Streaming sends OpenAI's events (`event: TYPE` + `data: JSON`, sequence_number from 0):
    response.created, response.in_progress, the output items' events
    (response_output_builder.py), then response.completed or response.incomplete; a failure
    after the stream began ends it with response.failed. A client that goes away aborts the
    engine request, as on the chat endpoint (ServingBase). A finished response is stored
    (store, default true) in the bounded ResponseStore, with its conversation.
    """

    def __init__(self, *args, chat: OpenAIServingChat, store: ResponseStore) -> None:
        super().__init__(*args)
        self.chat = chat
        self.store = store

    async def create_response(self, request: ResponsesRequest, raw_request: Request):
        run = await self._start(request)

        def body() -> dict:
            run.finish()
            return self._keep(run)

        events = lambda first, outputs: self._events(run, first, outputs)  # noqa: E731
        return await self.run_job(raw_request, run.job, run, request.stream, events, body)

    def retrieve(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise ResponseNotFoundError(response_id)
        return stored.response

    def input_items(
        self, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict:
        """A stored response's input items, a page at a time (OpenAI's list object)."""
        stored = self.store.get(response_id)
        if stored is None:
            raise ResponseNotFoundError(response_id)
        items = list(stored.input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidRequestError(
                    f"after: no input item {after!r} in {response_id}.", "after"
                )
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise ResponseNotFoundError(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # ---- a request as a chat job -------------------------------------------------------
    async def _start(self, request: ResponsesRequest) -> _ResponseRun:
        model = self.check_model(request.model)
        request.check()
        history = self._history(request.previous_response_id)
        history += input_messages(request.input)
        instructions = [ChatMessage(role="system", content=request.instructions)]
        messages = (instructions if request.instructions is not None else []) + history
        tools = request.function_tools()
        self.limits.check_tools(tools)  # before a grammar is built from them
        chat_request = request.chat_request(messages, tools)
        plan = plan_tools(chat_request, self.chat.tool_options)
        response_id = new_id("resp")
        constraint = request.constraint()
        job = await self.chat.build_job(
            chat_request, model, plan, response_id, RESPONSES_FIELDS, constraint
        )
        tracker = ChatTracker(
            chat_request, job, self.frontend.tokenizer, lambda: self.chat.reply_parser(plan, job)
        )
        items = input_items(request.input)
        return _ResponseRun(self._skeleton(request, job, tools), job, tracker, history, items)

    def _history(self, previous_response_id: str | None) -> list[ChatMessage]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise ResponseNotFoundError(previous_response_id, "previous_response_id")
        return list(stored.conversation)

    def _skeleton(self, request: ResponsesRequest, job: Job, tools) -> ResponseObject:
        params = job.params[0]
        return ResponseObject(
            id=job.request_id,
            model=job.model,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=request.metadata or {},
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            store=request.store and self.store.enabled,
            temperature=params.temperature,
            top_p=params.top_p,
            text=request.echoed_text(),
            tool_choice=request.echoed_tool_choice(bool(tools)),
            tools=[t.model_dump() for t in tools],
            top_logprobs=request.top_logprobs,
            user=request.user,
        )

    def _keep(self, run: _ResponseRun) -> dict:
        """The finished response's body, stored (with its conversation) if it asked."""
        body = run.response.model_dump(mode="json")
        if run.response.store:
            self.store.put(run.response.id, body, run.full_conversation(), run.input_items)
        return body

    # ---- streaming ---------------------------------------------------------------------
    async def _events(self, run: _ResponseRun, first, outputs):
        stream = _EventStream()
        async with contextlib.aclosing(outputs):
            try:
                yield stream.send({"type": "response.created", "response": _dump(run.response)})
                yield stream.send({"type": "response.in_progress", "response": _dump(run.response)})
                for event in run.update(*first):
                    yield stream.send(event)
                async for index, output in outputs:
                    for event in run.update(index, output):
                        yield stream.send(event)
                for event in run.finish():
                    yield stream.send(event)
                body = self._keep(run)
                kind = (
                    "response.completed" if body["status"] == "completed" else "response.incomplete"
                )
                yield stream.send({"type": kind, "response": body})
            except Exception as exc:
                logger.warning("response stream failed: %s", exc)
                run.fail(exc)
                yield stream.send({"type": "response.failed", "response": _dump(run.response)})


class _EventStream:
    """SSE frames as OpenAI sends them: `event: TYPE`, `data: JSON` with sequence_number."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, event: dict) -> str:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def _dump(response: ResponseObject) -> dict:
    return response.model_dump(mode="json")
