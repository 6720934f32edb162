"""GenerationServicer: the public pagestream.v1.Generation API over a FrontendSource.

A thin adapter: pb -> domain call (generation_pb) -> Frontend -> pb, with errors mapped to
status codes by services/common/grpc_errors. Every call first checks the API key (when
one is set: `authorization: Bearer KEY` metadata, else UNAUTHENTICATED), before its
`model` is resolved (a call without the key never starts a load); then it holds the
Frontend of that model (services/frontend/frontend_source.py) until it ends. A Generate
request is held to the frontend's size limits before anything renders or tokenizes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from services.common.convert.engine_io import served_model_info_to_pb
from services.common.convert.lora import lora_card_to_pb
from services.common.grpc_errors import grpc_errors
from services.common.proto.pagestream.v1 import generation_pb2, generation_pb2_grpc
from services.common.request_options import RequestOptions
from services.frontend import generation_pb, pooling_pb
from services.frontend.api_key import ApiKey
from services.frontend.frontend import Frontend
from services.frontend.frontend_source import FrontendSource
from services.frontend.input_processor import new_request_id
from services.frontend.multimodal.image_prompt import process_image_prompt
from services.frontend.pair_scoring import PairScoring, classification_params, classifier_pooler
from services.frontend.reasoning.engine_bounds import bound_reasoning
from services.frontend.reply_parser import ReplyParser

logger = logging.getLogger(__name__)


# How long stop() waits for the Generate calls it cancelled to end.
CANCEL_TIMEOUT_S = 2.0


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """A client that cancels a Generate stream, or whose deadline passes, aborts its request:
    the cancellation unwinds the stream (closing the Frontend's iterator aborts it in the
    engine core), and the RPC's done callback aborts it again should the stream be elsewhere
    at that moment. Until the Frontend exists (the split deployment connects to the
    scheduler first) every call answers UNAVAILABLE (OneFrontend).
    """

    def __init__(self, source: FrontendSource, api_key: ApiKey | None = None) -> None:
        self.source = source
        self.api_key = api_key or ApiKey(None)
        self.num_streams = 0
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        self._stream_tasks: set[asyncio.Task] = set()  # the Generate calls in flight
        self._background: set[asyncio.Task] = set()
        # (peer, the client's request_id) -> the engine's id for it. Ids are the client's
        # choice, so each Generate runs under an id of the server's: an Abort ends only
        # the caller's own connection's request, and one client cannot probe or take
        # another's ids. The Frontend beside it is the one running it (a model of many),
        # held by its Generate call as long as the entry exists.
        self._owned: dict[tuple[str, str], tuple[str, Frontend]] = {}

    def _authorize(self, context) -> None:
        if self.api_key.required:
            metadata = dict(context.invocation_metadata() or ())
            self.api_key.check(metadata.get("authorization"))

    def _hold(self, request, context):
        """The Frontend of the request's `model`, held while the context is open."""
        self._authorize(context)
        model, keep_alive = (pooling_pb.optional(request, f) for f in ("model", "keep_alive"))
        return self.source.hold(model, keep_alive)

    async def Generate(self, request, context) -> None:
        self.num_streams += 1
        self._no_streams.clear()
        task = asyncio.current_task()
        self._stream_tasks.add(task)
        try:
            await self._generate(request, context)
        finally:
            self._stream_tasks.discard(task)
            self.num_streams -= 1
            if self.num_streams == 0:
                self._no_streams.set()

    @grpc_errors
    async def _generate(self, request, context) -> None:
        async with self._hold(request, context) as frontend:
            await self._generate_on(frontend, request, context)

    async def _generate_on(self, frontend: Frontend, request, context) -> None:
        generation_pb.check_request_limits(request, frontend.limits)
        chat_text = await _chat_text(frontend, request, "prompt")
        call = generation_pb.generate_call_from_pb(
            request, chat_text, frontend.default_sampling, frontend.input_processor.loras
        )
        if chat_text is not None and (images := generation_pb.chat_images_pb(request.chat)):
            call = await _with_images(frontend, call, chat_text, images)
        reasoning = _bound_reasoning(frontend, call, chat_text)
        key = (context.peer(), call.request_id)
        if key in self._owned:
            raise ValueError(f"request_id {call.request_id!r} is already in use.")
        engine_id = new_request_id()
        self._owned[key] = (engine_id, frontend)
        try:
            self._abort_when_cancelled(context, frontend, engine_id)
            builder = generation_pb.ResponseBuilder(call.request_id, reasoning)
            stream = frontend.generate(**(call.arguments() | {"request_id": engine_id}))
            async with contextlib.aclosing(stream):
                async for output in stream:
                    for response in builder.responses(output):
                        await context.write(response)
        finally:
            del self._owned[key]

    @grpc_errors
    async def Abort(self, request, context) -> generation_pb2.AbortResponse:
        if not request.request_id:
            raise ValueError("request_id: give the id of the request to abort.")
        self._authorize(context)
        owned = self._owned.get((context.peer(), request.request_id))
        found = owned is not None and await owned[1].abort(owned[0])
        return generation_pb2.AbortResponse(found=found)

    @grpc_errors
    async def ListModels(self, request, context) -> generation_pb2.ListModelsResponse:
        self._authorize(context)
        default, listings = self.source.models()
        return generation_pb.list_models_response(default, listings)

    @grpc_errors
    async def Tokenize(self, request, context) -> generation_pb2.TokenizeResponse:
        async with self._hold(request, context) as frontend:
            generation_pb.check_tokenize_limits(request, frontend.limits)
            chat_text = await _chat_text(frontend, request, "input")
            return generation_pb.tokenize(request, frontend.tokenizer, frontend.info, chat_text)

    @grpc_errors
    async def Detokenize(self, request, context) -> generation_pb2.DetokenizeResponse:
        async with self._hold(request, context) as frontend:
            return generation_pb.detokenize(request, frontend.tokenizer, frontend.info)

    @grpc_errors
    async def GetModelInfo(self, request, context) -> generation_pb2.ModelInfo:
        async with self._hold(request, context) as frontend:
            info = served_model_info_to_pb(frontend.info)
            info.lora_adapters.extend(
                lora_card_to_pb(a) for a in frontend.input_processor.loras.adapters.values()
            )
            return info

    # The pooling calls run under engine ids of the server's (the client's request_id is
    # only echoed), for the reason Generate does.
    @grpc_errors
    async def Embed(self, request, context) -> generation_pb2.EmbedResponse:
        async with self._hold(request, context) as frontend:
            prompts = pooling_pb.embed_inputs_from_pb(request, frontend.limits)
            params = pooling_pb.embed_params_from_pb(request)
            request_id = request.request_id or new_request_id()
            outputs = await frontend.encode_many(
                prompts, params, new_request_id(), pooling_pb.request_options(request)
            )
            return pooling_pb.embed_response(request_id, outputs)

    @grpc_errors
    async def Score(self, request, context) -> generation_pb2.ScoreResponse:
        async with self._hold(request, context) as frontend:
            plan = self._plan(
                frontend, pooling_pb.score_pairs_from_pb(request, frontend.limits), request
            )
            request_id = request.request_id or new_request_id()
            outputs = await self._pool_plan(frontend, plan, request, new_request_id())
            return pooling_pb.score_response(request_id, plan, outputs)

    @grpc_errors
    async def Rerank(self, request, context) -> generation_pb2.RerankResponse:
        async with self._hold(request, context) as frontend:
            plan = self._plan(
                frontend, pooling_pb.rerank_pairs_from_pb(request, frontend.limits), request
            )
            request_id = request.request_id or new_request_id()
            outputs = await self._pool_plan(frontend, plan, request, new_request_id())
            return pooling_pb.rerank_response(request, request_id, plan, outputs)

    @grpc_errors
    async def Classify(self, request, context) -> generation_pb2.ClassifyResponse:
        async with self._hold(request, context) as frontend:
            pooler = classifier_pooler(frontend.input_processor.pooler)
            prompts = pooling_pb.embed_inputs_from_pb(request, frontend.limits)
            params = classification_params(pooling_pb.optional(request, "truncate_prompt_tokens"))
            request_id = request.request_id or new_request_id()
            outputs = await frontend.encode_many(
                prompts, params, new_request_id(), pooling_pb.request_options(request)
            )
            return pooling_pb.classify_response(request_id, pooler, outputs)

    @staticmethod
    def _plan(frontend: Frontend, pairs: list[tuple[str, str]], request) -> PairScoring:
        truncate = pooling_pb.optional(request, "truncate_prompt_tokens")
        return PairScoring.plan(
            pairs, frontend.input_processor.pooler, frontend.tokenizer, truncate
        )

    @staticmethod
    async def _pool_plan(frontend: Frontend, plan: PairScoring, request, request_id: str):
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in plan.prompts]
        options = RequestOptions(priority=request.priority)
        return await frontend.encode_many(prompts, plan.params, request_id, options)

    # ---- draining and cancellation -------------------------------------------------------
    async def drained(self) -> None:
        """Returns once no Generate stream is in flight."""
        await self._no_streams.wait()

    async def cancel_streams(self, timeout_s: float = CANCEL_TIMEOUT_S) -> None:
        """Cancel the Generate calls still in flight (each aborts its request) and wait
        for their tasks to end, grpc's own handling of the cancellation included: the
        server must not cancel its calls under a stream that still writes (grpc's aio
        core crashes when an RPC resumes after its server cancelled it)."""
        tasks = list(self._stream_tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    def _abort_when_cancelled(self, context, frontend: Frontend, request_id: str) -> None:
        loop = asyncio.get_running_loop()

        def done(ctx) -> None:
            if ctx.cancelled():
                loop.call_soon_threadsafe(self._spawn_abort, frontend, request_id)

        context.add_done_callback(done)

    def _spawn_abort(self, frontend: Frontend, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_quietly(frontend, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _abort_quietly(frontend: Frontend, request_id: str) -> None:
        # The model may have been unloaded since (its lease ended with the stream): the
        # abort then fails, and there is nothing left to abort.
        try:
            if await frontend.abort(request_id):
                logger.info("client cancelled %s: aborted it", request_id)
        except Exception:  # the engine is gone: nothing left to abort
            logger.debug("abort of cancelled %s failed", request_id, exc_info=True)


def _bound_reasoning(frontend: Frontend, call, chat_text: str | None):
    """The engine's view of the thinking (bound_reasoning) and, for a chat on a server
    with a reasoning parser, what splits each output's thinking into reasoning_text. Only
    a chat has a reply whose thinking the parser knows where to find: a text or token-id
    prompt gets no bounds (its grammar applies from the first token) and no budget."""
    params = call.sampling_params
    if chat_text is None:
        if params.thinking_token_budget is not None:
            raise ValueError(
                "sampling_params.thinking_token_budget: a thinking budget needs a chat "
                "prompt (the reasoning parser finds the thinking in chat replies)."
            )
        params.reasoning = None
        return None
    parser = frontend.reasoning_parser
    try:
        bound_reasoning(params, parser, frontend.tokenizer, chat_text)
    except ValueError as exc:
        raise ValueError(f"sampling_params.thinking_token_budget: {exc}") from exc
    if parser is None:
        return None
    return lambda: ReplyParser(parser.stream(chat_text), None)


async def _with_images(frontend: Frontend, call, chat_text: str, images: list):
    """The call with its chat's images loaded and expanded (process_image_prompt)."""
    try:
        processed = await process_image_prompt(
            frontend, chat_text, images, call.options.add_special_tokens
        )
    except ValueError as exc:
        raise ValueError(f"chat.messages: {exc}") from exc
    prompt = {
        "prompt": chat_text,
        "prompt_token_ids": processed.prompt_token_ids,
        "images": processed.images,
    }
    return dataclasses.replace(call, prompt=prompt)


async def _chat_text(frontend: Frontend, request, oneof: str) -> str | None:
    """The request's chat input rendered, when its `oneof` holds one."""
    if request.WhichOneof(oneof) != "chat":
        return None
    return await generation_pb.render_chat_pb(request.chat, frontend.chat_renderer)
