"""LLMEngine: frontend, engine core and worker wired together in one process."""

from __future__ import annotations

import logging
import weakref
from functools import partial

from pagestream.engine_args import EngineArgs
from pagestream.executor_factory import WORKER_START_TIMEOUT_S, build_executor
from services.common.outputs import RequestOutput
from services.common.pooling_params import PoolingParams
from services.common.request_options import DEFAULT_OPTIONS, RequestOptions
from services.common.sampling_params import SamplingParams
from services.common.worker_info import CacheInfo, ModelInfo
from services.frontend.input_processor import InputProcessor
from services.frontend.model_files import ModelFiles
from services.frontend.output_processor import OutputProcessor
from services.frontend.pooling_request_state import PoolingRequestState
from services.frontend.request_state import RequestState
from services.scheduler.engine_core_builder import EngineCoreBuilder
from services.scheduler.executor.uni import UniExecutor
from services.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    """The engine core (built as on every path, services/scheduler/engine_core_builder.py)
    and the frontend's input and output processing, stepped by the caller."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        # Read before the worker loads: a bad --generation-config fails before the weights.
        files = ModelFiles.load(args.model, args.generation_config)
        self.tokenizer, self.default_sampling = files.tokenizer, files.default_sampling
        self.images = files.images  # a VLM's image processor (None: text only)
        self.builder = EngineCoreBuilder(
            args, partial(build_executor, args), WORKER_START_TIMEOUT_S
        )
        self.core, self.info = self.builder.build(WORKER_START_TIMEOUT_S)
        # Worker processes (mp) stop with this engine, or at exit at the latest.
        self._finalizer = weakref.finalize(self, self.builder.close)
        self.executor = self.core.executor
        # The in-process Worker (uni), else None.
        self.worker = self.executor.worker if isinstance(self.executor, UniExecutor) else None
        self.input_processor = InputProcessor(self.tokenizer, self.info, self.images)
        self.output_processor = OutputProcessor()

    def close(self) -> None:
        """Stop the workers (mp: their processes); the engine cannot step afterwards."""
        self._finalizer()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def model_info(self) -> ModelInfo:
        """What the workers run (the group's whole model under TP / PP)."""
        return self.builder.model

    @property
    def cache_info(self) -> CacheInfo:
        return self.builder.cache

    def add_request(
        self,
        request_id: str | None,
        prompt,
        params: SamplingParams | PoolingParams,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> RequestState | PoolingRequestState:
        """Validate, tokenize and admit a generation (SamplingParams) or a pooling request
        (PoolingParams: the engine runs --runner pooling); raises ValueError naming the
        problem."""
        request, state = self.input_processor.make_request(request_id, prompt, params, options)
        self._admit(request, state)
        return state

    def _admit(self, request, state) -> None:
        self.output_processor.add(state)  # refuses an id in use
        try:
            self.core.add_request(request)
        except BaseException:
            self.output_processor.remove(state.request_id)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort; each request still gets a final output (finish_reason "abort") next step."""
        self.core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.states) or self.core.has_work()

    def step(self) -> list[RequestOutput]:
        """One engine step; the RequestOutputs it produced (by each request's output_kind)."""
        batches = self.core.step()
        outputs = [o for batch in batches.values() for o in batch.outputs]
        ready, to_abort = self.output_processor.process(outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return [output for _, output in ready]
