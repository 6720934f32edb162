"""LLMEngine: frontend, engine core and worker wired together in one process."""

from __future__ import annotations

import itertools
import logging
import weakref

from pagestream.engine_args import EngineArgs
from pagestream.executor_factory import build_executor
from services.common.engine_request import EngineCoreRequest
from services.common.model_info import ServedModelInfo
from services.common.model_source import resolve_model
from services.common.outputs import RequestOutput
from services.common.sampling_params import SamplingParams
from services.frontend.generation_defaults import load_generation_defaults
from services.frontend.input_processor import InputProcessor
from services.frontend.output_processor import OutputProcessor
from services.frontend.request_state import RequestState
from services.frontend.tokenizer import try_load_tokenizer
from services.scheduler.engine_core import EngineCore
from services.scheduler.scheduler import Scheduler
from services.scheduler.structured_output_manager import (
    StructuredOutputManager,
    tokenizer_json_of,
)

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        cache_config = args.cache_config()
        self.executor = build_executor(args)
        try:
            self._start(args, cache_config)
        except BaseException:
            self.executor.close()
            raise
        # Worker processes (mp) stop with this engine, or at exit at the latest.
        self._finalizer = weakref.finalize(self, self.executor.close)

    def _start(self, args: EngineArgs, cache_config) -> None:
        executor = self.executor.executor
        self.worker = self.executor.worker  # the in-process Worker (uni), else None
        self.model_info = executor.describe()
        self.scheduler_config = args.scheduler_config(
            self.model_info.max_model_len, self.model_info.device
        )
        self.cache_info = executor.initialize_cache(
            self.scheduler_config.max_model_len,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_num_batched_tokens,
        )
        structured = StructuredOutputManager(
            tokenizer_json_of(args.model),
            self.model_info.vocab_size,
            self.model_info.eos_token_ids,
        )
        scheduler = Scheduler(
            self.scheduler_config,
            cache_config,
            self.cache_info.num_gpu_blocks,
            self.cache_info.num_cpu_blocks,
            structured,
        )
        self.core = EngineCore(scheduler, executor)
        folder = resolve_model(args.model)
        self.tokenizer = try_load_tokenizer(folder)
        self.default_sampling = load_generation_defaults(folder, args.generation_config)
        self.input_processor = InputProcessor(
            self.tokenizer, self.scheduler_config.max_model_len, self.model_info.vocab_size
        )
        self.output_processor = OutputProcessor()
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the workers (mp: their processes); the engine cannot step afterwards."""
        self._finalizer()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def served_model_info(self) -> ServedModelInfo:
        info = self.model_info
        return ServedModelInfo(
            model=self.args.served_model_name or self.args.model,
            max_model_len=self.scheduler_config.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            block_size=self.args.block_size,
            architecture=info.architecture,
            dtype=info.dtype,
            num_gpu_blocks=self.cache_info.num_gpu_blocks,
            quantization=info.quantization,
            weight_bytes=info.weight_bytes,
        )

    def add_request(
        self,
        request_id: str | None,
        prompt,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
    ) -> RequestState:
        """Validate, tokenize and admit; raises ValueError naming the problem."""
        request_id = request_id or self.new_request_id()
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        processed = self.input_processor.process(prompt, add_special_tokens)
        self.input_processor.check_params(params)
        eos = self.model_info.eos_token_ids
        self.core.add_request(
            EngineCoreRequest(
                request_id=request_id,
                prompt_token_ids=processed.prompt_token_ids,
                sampling_params=params,
                eos_token_id=eos[0] if eos else None,
                extra_stop_token_ids=tuple(eos[1:]),
                priority=priority,
                cache_salt=cache_salt,
            )
        )
        state = RequestState(
            request_id, processed.prompt, processed.prompt_token_ids, params, self.tokenizer
        )
        self.output_processor.add(state)
        return state

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
