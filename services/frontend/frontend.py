"""Frontend: prompts in, streamed RequestOutputs out, over any EngineCoreClient.

It validates and tokenizes (nothing half-admitted on bad input), sends EngineCoreRequests,
and turns the engine core's per-step outputs into per-request streams: incremental
detokenization, stop strings (which abort the sequence in the engine core), output kinds.
The OpenAI HTTP server and the public gRPC Generation service both sit on this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from services.common.backoff import Backoff
from services.common.engine_errors import EngineUnavailableError
from services.common.engine_output import SchedulerStats
from services.common.outputs import PoolingRequestOutput, RequestOutput
from services.common.pooling_params import PoolingParams
from services.common.request_options import DEFAULT_OPTIONS, RequestOptions
from services.common.sampling_defaults import sampling_params_with_defaults
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.common.served_model_info import ServedModelInfo
from services.frontend.chat_renderer import ChatRenderer
from services.frontend.engine_client import EngineCoreClient, output_error
from services.frontend.frontend_config import FrontendConfig
from services.frontend.input_processor import InputProcessor, new_request_id
from services.frontend.multimodal.image_loader import ImageLoader
from services.frontend.output_processor import OutputProcessor
from services.frontend.output_queue import RequestOutputQueue, SlowConsumerError
from services.frontend.reasoning import get_reasoning_parser
from services.frontend.request_limits import RequestLimits

logger = logging.getLogger(__name__)
# One encode_many call keeps at most this many engine requests in flight: a request of
# 2048 inputs (OpenAI's limit) then fits under the serving bound on waiting requests
# (1024), and a large batch never floods the queue ahead of other clients' requests.
ENCODE_WINDOW = 256

__all__ = ["Frontend", "RequestTimeoutError"]

# Between losses with no output in between: the first reconnect is immediate.
RECONNECT_BACKOFF = Backoff((0.0, 0.25, 0.5, 1.0, 2.0))


class RequestTimeoutError(TimeoutError):
    """The request outlived the server's request timeout and was aborted."""


class Frontend:
    """Each stream reads from a RequestOutputQueue, so a consumer that lags never holds up the
    output pump (its deltas merge) and one that stops reading is aborted past a bound. When
    the connection to the engine core breaks, every stream ends with EngineUnavailableError,
    the frontend reports not ready and reconnects (EngineCoreClient.reconnect) until the
    engine core is back; requests that arrive meanwhile are refused at once. Readiness
    (`is_ready`: connected, and the engine core serving) is what health probes report;
    `is_alive` turns false only when the engine core can never come back (an in-process
    engine whose loop died).
    """

    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer,
        info: ServedModelInfo,
        default_sampling: dict | None = None,
        config: FrontendConfig | None = None,
        images=None,
    ) -> None:
        """`images`: a vision-language model's ImageProcessor (ModelFiles.images)."""
        self.client = client
        self.tokenizer = tokenizer
        self.info = info
        # The model's generation_config defaults for unset fields (generation_defaults.py).
        self.default_sampling = dict(default_sampling or {})
        self.config = config or FrontendConfig()
        self.limits = RequestLimits(self.config, info.max_model_len)
        self.chat_renderer = ChatRenderer(tokenizer, self.config, self.limits.max_prompt_bytes)
        # The model's thinking format (--reasoning-parser): every chat API splits replies
        # with it (reply_parser.py).
        self.reasoning_parser = (
            get_reasoning_parser(self.config.reasoning_parser)
            if self.config.reasoning_parser
            else None
        )
        self.input_processor = InputProcessor(tokenizer, info, images)
        self.image_loader = ImageLoader(self.config)  # requests' images, within its bounds
        self.output_processor = OutputProcessor()
        self._queues: dict[str, RequestOutputQueue] = {}
        self._pump: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.last_stats = SchedulerStats()
        self.dead_error: BaseException | None = None  # the engine core cannot come back
        self._connected = True
        self._epoch = 0  # counts lost connections: requests added across one may be orphans
        self._readiness_listeners: list[Callable[[bool], None]] = []
        self._last_ready = self.is_ready
        client.on_ready_change = lambda _ready: self._readiness_changed()
        with contextlib.suppress(RuntimeError):  # no running loop: the first request starts it
            self._ensure_pump()

    # ---- liveness and readiness ------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """False only once the engine core can never come back (restart this process)."""
        return self.dead_error is None

    @property
    def is_ready(self) -> bool:
        """The whole chain can serve: connected to an engine core that reports serving."""
        return self.dead_error is None and self._connected and self.client.ready

    def not_ready_reason(self) -> str:
        if self.dead_error is not None:
            return f"the engine is not available: {self.dead_error}"
        if not self._connected:
            return "the engine core is not available: reconnecting to it"
        return "the engine core is not ready: its workers are away and it is reconnecting"

    def add_readiness_listener(self, listener: Callable[[bool], None]) -> None:
        """`listener(is_ready)` is called on every change of readiness."""
        self._readiness_listeners.append(listener)

    def _readiness_changed(self) -> None:
        ready = self.is_ready
        if ready == self._last_ready:
            return
        self._last_ready = ready
        logger.info("frontend %s", "ready" if ready else "not ready: " + self.not_ready_reason())
        for listener in list(self._readiness_listeners):
            listener(ready)

    def num_live_requests(self) -> int:
        return len(self._queues)

    # ---- requests ----------------------------------------------------------------------
    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs until the request ends; a consumer that stops iterating aborts it."""
        params = sampling_params or sampling_params_with_defaults({}, self.default_sampling)
        request, state = self._make(request_id, prompt, params, options)
        async for output in self._submit(request, state, params.output_kind):
            yield output

    async def encode(
        self,
        prompt,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> PoolingRequestOutput:
        """One prompt's pooled output (an engine running --runner pooling); ValueError
        naming the problem for bad input or a generate engine."""
        ids = None if request_id is None else [request_id]
        return (await self._encode([prompt], pooling_params, ids, options))[0]

    async def encode_many(
        self,
        prompts: list,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> list[PoolingRequestOutput]:
        """Several prompts' pooled outputs, in order (engine requests `request_id`-i, run
        side by side); every prompt is checked before any is admitted, and the first that
        fails ends the others."""
        base = request_id or new_request_id()
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        return await self._encode(prompts, pooling_params, ids, options)

    async def _encode(self, prompts, params, request_ids, options) -> list[PoolingRequestOutput]:
        params = params or PoolingParams()
        requests = [
            self._make(request_ids[i] if request_ids else None, prompt, params, options)
            for i, prompt in enumerate(prompts)
        ]
        try:
            async with asyncio.TaskGroup() as group:  # one failing cancels (aborts) the rest
                window = asyncio.Semaphore(ENCODE_WINDOW)
                tasks = [group.create_task(self._pooled(r, s, window)) for r, s in requests]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None  # the first error, as a single request's
        return [task.result() for task in tasks]

    def _make(self, request_id, prompt, params, options: RequestOptions):
        """A checked engine request and its state (not admitted yet): the engine is ready,
        the id is free, the prompt within the size limit before it is tokenized."""
        if not self.is_ready:
            raise EngineUnavailableError(self.not_ready_reason())
        self._ensure_pump()
        if request_id in self._queues:  # its stream may outlive its state: check both
            raise ValueError(f"request_id {request_id!r} is already in use.")
        self._check_prompt_size(prompt)
        if isinstance(params, SamplingParams):
            self.limits.check_sampling(params)
        return self.input_processor.make_request(request_id, prompt, params, options)

    async def _pooled(self, request, state, window: asyncio.Semaphore) -> PoolingRequestOutput:
        final = None
        async with window:
            async for output in self._submit(request, state, RequestOutputKind.FINAL_ONLY):
                final = output
        if final is None or final.outputs is None:
            raise EngineUnavailableError(final.error if final else "the request ended early")
        return final

    async def _submit(self, request, state, output_kind: RequestOutputKind):
        """Admit a request and stream its outputs (a consumer that stops aborts it)."""
        self.output_processor.add(state)  # refuses an id in use
        queue = RequestOutputQueue(output_kind, self.config.max_unread_tokens)
        self._queues[request.request_id] = queue
        deadline = self._deadline()
        epoch = self._epoch
        try:
            await self.client.add_request(request)
        except asyncio.CancelledError:
            self._withdraw(request.request_id)
            raise
        except BaseException:
            self._forget(request.request_id)
            raise
        if epoch != self._epoch:  # sent on a new connection after its stream was failed
            self._spawn(self.client.abort([request.request_id]))
        async for output in self._stream(request.request_id, queue, deadline):
            yield output

    def _check_prompt_size(self, prompt) -> None:
        """The prompt-size limit before tokenizing (the public APIs check their own
        fields, n included, before they get here)."""
        text = _text_to_tokenize(prompt)
        if text is not None:
            self.limits.check_prompt_text(text)

    def _deadline(self) -> float | None:
        timeout = self.config.request_timeout_s
        return None if timeout is None else asyncio.get_running_loop().time() + timeout

    async def _stream(self, request_id: str, queue: RequestOutputQueue, deadline):
        finished = False
        try:
            while not finished:
                try:
                    output = await self._next(request_id, queue, deadline)
                except Exception:
                    finished = True  # the request already ended (or was aborted) there
                    raise
                finished = output.finished
                yield output
        finally:
            if finished:
                self._forget(request_id)
            else:  # the consumer went away: abort, and keep the id until the abort lands
                self._abandon(request_id)

    async def _next(self, request_id: str, queue: RequestOutputQueue, deadline) -> RequestOutput:
        if deadline is None:
            return await queue.get()
        try:
            async with asyncio.timeout_at(deadline):
                return await queue.get()
        except TimeoutError:
            timeout = self.config.request_timeout_s
            logger.warning(
                "request %s ran past the request timeout (%ss): aborting", request_id, timeout
            )
            self._spawn(self.client.abort([request_id]))
            raise RequestTimeoutError(
                f"the request ran longer than the server's request timeout of {timeout}s "
                "(--request-timeout) and was aborted."
            ) from None

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.output_processor.remove(request_id)
        self.client.release(request_id)

    def _abandon(self, request_id: str) -> None:
        """A request whose consumer stopped before its end: its outputs are dropped from
        now on, the engine core is told to abort it, and its state stays (the id refused
        as in use) until the engine core's final output for it arrives, so a request
        re-added under the same id is never the one that abort ends."""
        self._queues.pop(request_id, None)
        self._spawn(self.client.abort([request_id]))

    def _withdraw(self, request_id: str) -> None:
        """A request whose caller was cancelled while it was being added: the engine core
        may have it (or get it: the client sends a started add whole), with nobody left to
        read it. Abort it, and forget it once the abort is sent after the add: the stream
        is ordered, so the abort cannot end a later request under the same id."""
        self._queues.pop(request_id, None)
        self._spawn(self._abort_then_forget(request_id))

    async def _abort_then_forget(self, request_id: str) -> None:
        try:
            await self.client.abort([request_id])
        finally:
            self._forget(request_id)

    async def abort(self, request_id: str) -> bool:
        """End a request; its stream gets a final output with finish_reason "abort"."""
        if request_id not in self._queues:
            return False
        await self.client.abort([request_id])
        return True

    async def stats(self) -> SchedulerStats:
        return await self.client.stats()

    async def engine_stats(self) -> dict[str, SchedulerStats]:
        """Per engine core (the `engine` label of the metrics): "0" unless data-parallel."""
        return await self.client.engine_stats()

    def routing_counts(self) -> dict[tuple[str, str], int]:
        """Requests per (engine, reason) a data-parallel router sent; empty otherwise."""
        return self.client.routing_counts()

    # ---- the output pump ---------------------------------------------------------------
    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(_quietly(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _run_pump(self) -> None:
        """Route outputs; on a lost connection fail every stream and reconnect."""
        failures = 0
        while True:
            try:
                while True:
                    batch = await self.client.next_outputs()
                    failures = 0
                    if batch.scheduler_stats is not None:
                        self.last_stats = batch.scheduler_stats
                    self._deliver(batch.outputs)
            except Exception as exc:
                self._connection_lost(exc)
            await asyncio.sleep(RECONNECT_BACKOFF.delay(failures))
            failures += 1
            try:
                await self.client.reconnect()
            except Exception as exc:
                logger.error("the engine core cannot come back (%s): the frontend is dead", exc)
                self.dead_error = exc
                self._readiness_changed()
                return
            self._connected = True
            self._readiness_changed()

    def _connection_lost(self, exc: Exception) -> None:
        if isinstance(exc, EngineUnavailableError):
            logger.error("lost the engine core: %s", exc)
        else:
            logger.exception("the output pump failed; reconnecting to the engine core")
        self._connected = False
        self._epoch += 1
        error = EngineUnavailableError(f"the engine is not available: {exc}")
        if self._queues:
            logger.error("failing %d in-flight request(s)", len(self._queues))
        for queue in self._queues.values():
            queue.put_error(error)
        for request_id in [r for r in self.output_processor.states if r not in self._queues]:
            self._forget(request_id)  # abandoned: their aborts will not be answered
        self._readiness_changed()

    def _deliver(self, outputs) -> None:
        for output in (o for o in outputs if o.error):  # rejections, lost workers
            request_id = output.parent_request_id or output.request_id
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_error(output_error(output.error_code, output.error))
            elif request_id in self.output_processor.states:
                self._forget(request_id)  # abandoned (_abandon): it ended there
        ready, to_abort = self.output_processor.process([o for o in outputs if not o.error])
        for state, output in ready:
            queue = self._queues.get(state.request_id)
            if queue is None and state.finished:
                self.client.release(state.request_id)  # abandoned, and now ended there
            if queue is not None and not queue.put(output):
                self._overflowed(state.request_id, queue)
                to_abort.append(state.request_id)
        if to_abort:
            self._spawn(self.client.abort(to_abort))

    def _overflowed(self, request_id: str, queue: RequestOutputQueue) -> None:
        """The consumer left more than max_unread_tokens unread: abort the request."""
        logger.warning(
            "request %s: its client left %d tokens unread (max_unread_tokens=%d): aborting it",
            request_id,
            queue.unread_tokens,
            queue.max_unread_tokens,
        )
        self.output_processor.remove(request_id)  # later outputs are dropped
        queue.put_error(
            SlowConsumerError(
                f"the client stopped reading: more than {queue.max_unread_tokens} tokens "
                "were left unread (--max-unread-tokens), so the request was aborted."
            )
        )

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        await self.chat_renderer.close()
        await self.client.close()


def _text_to_tokenize(prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None


async def _quietly(coro) -> None:
    """Background engine calls (aborts): an engine that is gone has nothing left to abort."""
    try:
        await coro
    except EngineUnavailableError as exc:
        logger.debug("background engine call skipped: %s", exc)
