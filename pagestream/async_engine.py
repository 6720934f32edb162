"""AsyncEngine: the in-process engine behind an asyncio API that streams RequestOutputs.

The engine step (forward pass included) runs on one executor thread, never on the event
loop. Adds and aborts take the same lock as a step, so they land between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from pagestream.engine_args import EngineArgs
from pagestream.llm_engine import LLMEngine
from services.common.outputs import RequestOutput
from services.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served any more."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborts: set[str] = set()
        self._lock: asyncio.Lock | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagestream-step")
        self.dead_error: BaseException | None = None

    @classmethod
    def from_args(cls, model: str | None = None, **engine_args) -> AsyncEngine:
        if model is not None:
            engine_args["model"] = model
        return cls(LLMEngine(EngineArgs.from_kwargs(**engine_args)))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncEngine:
        return cls(LLMEngine(args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self.dead_error is None

    def _ensure_loop(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.dead_error!r}")
        if self._loop_task is None or self._loop_task.done():
            self._lock = asyncio.Lock()
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs (cumulative or delta, per output_kind) until the request ends.

        kwargs: priority, cache_salt, add_special_tokens. A consumer that stops iterating
        aborts the request.
        """
        self._ensure_loop()
        params = sampling_params or SamplingParams()
        request_id = request_id or self.engine.new_request_id()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            async with self._lock:
                self.engine.add_request(request_id, prompt, params, **kwargs)
            self._wakeup.set()
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine loop failed: {item!r}") from item
                finished = item.finished
                yield item
        except ValueError:
            finished = True  # rejected at admission: nothing to abort
            raise
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._aborts.add(request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        """End a request; its stream gets a final output with finish_reason "abort"."""
        self._aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wakeup.clear()
                if not (self.engine.has_unfinished_requests() or self._aborts):
                    await self._wakeup.wait()
                    continue
                async with self._lock:
                    if self._aborts:
                        aborts, self._aborts = list(self._aborts), set()
                        self.engine.abort_request(aborts)
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                for output in outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine is broken: end every stream with the error
            logger.exception("engine loop failed")
            self.dead_error = exc
            for queue in self._queues.values():
                queue.put_nowait(exc)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._executor.shutdown(wait=True)
