"""LLMEngine: frontend, engine core and worker wired together in one process."""

from __future__ import annotations

import itertools
import logging

from pagestream.engine_args import EngineArgs
from services.common.outputs import RequestOutput
from services.common.sampling_params import SamplingParams
from services.frontend.input_processor import InputProcessor
from services.frontend.output_processor import OutputProcessor
from services.frontend.request_state import RequestState
from services.frontend.tokenizer import TokenizerLoadError, load_tokenizer
from services.scheduler.engine_core import EngineCore
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.default_model import resolve_model
from services.worker.worker import Worker

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        cache_config = args.cache_config()
        self.worker = Worker(args.model_config(), cache_config)
        self.model_info = self.worker.describe()
        self.scheduler_config = args.scheduler_config(self.model_info.max_model_len)
        self.cache_info = self.worker.initialize_cache(
            self.scheduler_config.max_model_len,
            self.scheduler_config.max_num_seqs,
            self.scheduler_config.max_num_batched_tokens,
        )
        scheduler = Scheduler(
            self.scheduler_config,
            cache_config,
            self.cache_info.num_gpu_blocks,
            self.cache_info.num_cpu_blocks,
        )
        self.core = EngineCore(scheduler, self.worker)
        self.tokenizer = _try_load_tokenizer(args.model)
        self.input_processor = InputProcessor(
            self.tokenizer, self.scheduler_config.max_model_len, self.model_info.vocab_size
        )
        self.output_processor = OutputProcessor()
        self._ids = itertools.count()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

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
        request = self._make_request(request_id, processed.prompt_token_ids, params)
        request.priority, request.cache_salt = priority, cache_salt
        if cache_salt:
            request.block_hashes = []
            request.update_block_hashes()
        state = RequestState(
            request_id, processed.prompt, processed.prompt_token_ids, params, self.tokenizer
        )
        self.core.add_request(request)
        self.output_processor.add(state)
        return state

    def _make_request(self, request_id: str, prompt_token_ids: list[int], params) -> Request:
        eos_ids = self.model_info.eos_token_ids
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=eos_ids[0] if eos_ids else None,
            block_size=self.args.block_size,
        )
        if len(eos_ids) > 1 and not params.ignore_eos:
            # Extra EOS ids from generation_config stop the request as stop tokens do.
            params.all_stop_token_ids = params.all_stop_token_ids | set(eos_ids[1:])
        return request

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


def _try_load_tokenizer(model: str):
    try:
        return load_tokenizer(resolve_model(model))
    except TokenizerLoadError as exc:
        logger.warning("%s; only token-id prompts will work and outputs have no text", exc)
        return None
