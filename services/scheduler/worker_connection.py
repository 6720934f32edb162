"""WorkerConnection: the scheduler role's link to its worker group, made and remade.

`connect(timeout_s)` waits for every rank, checks they describe one model in the right
places, sizes the KV cache over the group, and returns a fresh EngineCore (a new block
pool: nothing survives from an earlier connection). After the workers were lost,
`reconnect()` closes the old executor and does the same again with a short wait, and
refuses a worker group that now runs a different model.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from services.common.config import CacheConfig, SchedulerConfig
from services.common.model_info import ServedModelInfo
from services.common.tls import TlsConfig
from services.common.worker_info import ModelInfo
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor.worker_group import WorkerGroupExecutor
from services.scheduler.scheduler import Scheduler
from services.scheduler.structured_output_manager import (
    StructuredOutputManager,
    tokenizer_json_of,
)

logger = logging.getLogger(__name__)

RECONNECT_WAIT_S = 5.0


class SchedulerArgs(Protocol):
    """What the scheduler role needs from pagestream.engine_args.EngineArgs."""

    model: str
    served_model_name: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    async_scheduling: bool

    def cache_config(self) -> CacheConfig: ...

    def scheduler_config(self, model_max_len: int, device: str = ...) -> SchedulerConfig: ...


class WorkerConnection:
    def __init__(
        self, addresses: list[str], args: SchedulerArgs, tls: TlsConfig | None = None
    ) -> None:
        self.addresses = addresses
        self.args = args
        self.tls = tls
        self.model: ModelInfo | None = None  # what the first connection found
        self.executor: WorkerGroupExecutor | None = None

    def connect(self, timeout_s: float) -> tuple[EngineCore, ServedModelInfo]:
        """Blocking (run it on a thread). Raises ConnectionError / TimeoutError while the
        workers are away, ValueError when they do not form the group asked for."""
        args = self.args
        executor = WorkerGroupExecutor(
            self.addresses,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            args.async_scheduling,
            self.tls,
        )
        try:
            core, info = self._build(executor, timeout_s)
        except BaseException:
            executor.close()
            raise
        self.executor = executor
        return core, info

    def reconnect(self) -> EngineCore:
        """After a loss: drop the old streams and connect again (one short attempt)."""
        self.close()
        core, _ = self.connect(RECONNECT_WAIT_S)
        return core

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None

    def _build(
        self, executor: WorkerGroupExecutor, timeout_s: float
    ) -> tuple[EngineCore, ServedModelInfo]:
        executor.wait_until_ready(timeout_s)
        model = executor.describe()
        if self.model is not None and model.model_fields() != self.model.model_fields():
            raise ValueError(
                f"the workers at {', '.join(self.addresses)} now run {model.model} "
                f"({model.model_fields()}), not {self.model.model}: restart the scheduler"
            )
        self.model = model
        config = self.args.scheduler_config(model.max_model_len, model.device)
        cache_info = executor.initialize_cache(
            config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens
        )
        cache_config = self.args.cache_config()
        if cache_config.block_size != cache_info.block_size:
            logger.warning(
                "block_size %d differs from the worker's %d: using the worker's",
                cache_config.block_size,
                cache_info.block_size,
            )
            cache_config = replace(cache_config, block_size=cache_info.block_size)
        structured = StructuredOutputManager(
            tokenizer_json_of(self.args.model), model.vocab_size, model.eos_token_ids
        )
        scheduler = Scheduler(
            config, cache_config, cache_info.num_gpu_blocks, cache_info.num_cpu_blocks, structured
        )
        info = ServedModelInfo(
            model=self.args.served_model_name or model.model,
            max_model_len=config.max_model_len,
            vocab_size=model.vocab_size,
            eos_token_ids=model.eos_token_ids,
            block_size=cache_info.block_size,
            architecture=model.architecture,
            dtype=model.dtype,
            num_gpu_blocks=cache_info.num_gpu_blocks,
            quantization=model.quantization,
            weight_bytes=model.weight_bytes,
        )
        return EngineCore(scheduler, executor), info
