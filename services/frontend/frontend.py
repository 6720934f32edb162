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
import uuid
from collections.abc import AsyncIterator

from services.common.engine_output import SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.common.model_info import ServedModelInfo
from services.common.outputs import RequestOutput
from services.common.sampling_params import SamplingParams
from services.frontend.engine_client import EngineCoreClient, EngineUnavailableError
from services.frontend.input_processor import InputProcessor
from services.frontend.output_processor import OutputProcessor
from services.frontend.request_state import RequestState

logger = logging.getLogger(__name__)
__all__ = ["EngineUnavailableError", "Frontend"]  # the error is the client interface's


class Frontend:
    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer,
        info: ServedModelInfo,
        default_sampling: dict | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.info = info
        # The model's generation_config defaults for unset fields (generation_defaults.py).
        self.default_sampling = dict(default_sampling or {})
        self.input_processor = InputProcessor(tokenizer, info.max_model_len, info.vocab_size)
        self.output_processor = OutputProcessor()
        self._queues: dict[str, asyncio.Queue] = {}
        self._pump: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.last_stats = SchedulerStats()
        self.dead_error: BaseException | None = None

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None

    def num_live_requests(self) -> int:
        return len(self._queues)

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs until the request ends; a consumer that stops iterating aborts it."""
        if self.dead_error is not None:
            raise EngineUnavailableError(f"the engine is not available: {self.dead_error}")
        self._ensure_pump()
        params = sampling_params or SamplingParams(**self.default_sampling)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        processed = self.input_processor.process(prompt, add_special_tokens)
        self.input_processor.check_params(params)
        queue: asyncio.Queue = asyncio.Queue()
        state = RequestState(
            request_id, processed.prompt, processed.prompt_token_ids, params, self.tokenizer
        )
        self._queues[request_id] = queue
        self.output_processor.add(state)
        try:
            await self.client.add_request(self._engine_request(state, priority, cache_salt))
        except BaseException:
            self._forget(request_id)
            raise
        async for output in self._stream(request_id, queue):
            yield output

    def _engine_request(self, state: RequestState, priority: int, cache_salt) -> EngineCoreRequest:
        eos = self.info.eos_token_ids
        return EngineCoreRequest(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            sampling_params=state.params,
            eos_token_id=eos[0] if eos else None,
            extra_stop_token_ids=tuple(eos[1:]),
            priority=priority,
            cache_salt=cache_salt,
        )

    async def _stream(self, request_id: str, queue: asyncio.Queue):
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._forget(request_id)
            if not finished:
                self._spawn(self.client.abort([request_id]))

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.output_processor.remove(request_id)

    async def abort(self, request_id: str) -> bool:
        """End a request; its stream gets a final output with finish_reason "abort"."""
        if request_id not in self._queues:
            return False
        await self.client.abort([request_id])
        return True

    async def stats(self) -> SchedulerStats:
        return await self.client.stats()

    # ---- the output pump -----------------------------------------------------------
    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _run_pump(self) -> None:
        try:
            while True:
                batch = await self.client.next_outputs()
                if batch.scheduler_stats is not None:
                    self.last_stats = batch.scheduler_stats
                self._deliver(batch.outputs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("lost the engine core")
            self.dead_error = exc
            error = EngineUnavailableError(f"the engine is not available: {exc}")
            for queue in self._queues.values():
                queue.put_nowait(error)

    def _deliver(self, outputs) -> None:
        rejected = [o for o in outputs if o.error]
        for output in rejected:  # admission errors arrive as outputs over gRPC
            queue = self._queues.get(output.parent_request_id or output.request_id)
            if queue is not None:
                queue.put_nowait(ValueError(output.error))
        ready, to_abort = self.output_processor.process([o for o in outputs if not o.error])
        if to_abort:
            self._spawn(self.client.abort(to_abort))
        for state, output in ready:
            queue = self._queues.get(state.request_id)
            if queue is not None:
                queue.put_nowait(output)

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        await self.client.close()
