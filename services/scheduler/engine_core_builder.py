"""EngineCoreBuilder: the one way an engine core is made, on every path.

The offline LLMEngine, the engine-core process and the `scheduler` role (over its own
workers or over `--worker` addresses) all build through this class, so they size, check
and recover alike. The steps of a build and a rebuild: EngineCoreBuilder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from services.common.compatibility import check_with_model
from services.common.config import CacheConfig, ModelConfig, SchedulerConfig
from services.common.served_model_info import ServedModelInfo
from services.common.speculative_config import SpeculativeConfig
from services.common.worker_info import CacheInfo, ModelInfo
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor.executor import Executor
from services.scheduler.kv_offload_tiers import offload_index_for
from services.scheduler.scheduler import Scheduler
from services.scheduler.structured_output_manager import (
    StructuredOutputManager,
    tokenizer_json_of,
)

logger = logging.getLogger(__name__)

# timeout_s -> a ready executor (its workers loaded and serving)
ExecutorFactory = Callable[[float], Executor]


class EngineCoreArgs(Protocol):
    """What building an engine core needs from pagestream.engine_args.EngineArgs."""

    model: str
    served_model_name: str | None

    def cache_config(self) -> CacheConfig: ...

    def model_config(self) -> ModelConfig: ...

    def scheduler_config(self, model_max_len: int, device: str = ...) -> SchedulerConfig: ...


class EngineCoreBuilder:
    """`build(timeout_s)` gets a ready executor from `make_executor` (the in-process worker, a
    worker group the engine starts, or workers someone else started), then: describe the
    model → the scheduler's limits for it → size the KV cache over the workers (their block
    size wins) → the structured-output manager → Scheduler → EngineCore, and the
    ServedModelInfo the frontends see. `rebuild()` (after the workers were lost) closes the
    old executor and does the same again over a fresh one, refusing workers that now run a
    different model; nothing survives from an earlier build (a new block pool).
    """

    def __init__(
        self, args: EngineCoreArgs, make_executor: ExecutorFactory, rebuild_timeout_s: float
    ) -> None:
        self.args = args
        self.make_executor = make_executor
        self.rebuild_timeout_s = rebuild_timeout_s  # how long one rebuild waits for workers
        self.model: ModelInfo | None = None  # what the first build found
        self.cache: CacheInfo | None = None  # the KV cache the last build laid out
        self.executor: Executor | None = None

    def build(self, timeout_s: float) -> tuple[EngineCore, ServedModelInfo]:
        """Blocking (run it on a thread). Raises ConnectionError / TimeoutError while the
        workers are away, ValueError when they do not form the group asked for."""
        executor = self.make_executor(timeout_s)
        try:
            core, info = self._assemble(executor)
        except BaseException:
            executor.close()
            raise
        self.executor = executor
        return core, info

    def rebuild(self) -> EngineCore:
        """After a loss: drop the old executor and build again (one attempt)."""
        self.close()
        core, _ = self.build(self.rebuild_timeout_s)
        return core

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None

    def _assemble(self, executor: Executor) -> tuple[EngineCore, ServedModelInfo]:
        model = self._check_model(executor.describe())
        pooler = model.capabilities.pooler
        whole = pooler is not None and pooler.whole_prompt
        config = self.args.scheduler_config(model.max_model_len, model.device, whole)
        self.cache = cache_info = executor.initialize_cache(
            config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens
        )
        structured = StructuredOutputManager(
            tokenizer_json_of(self.args.model), model.vocab_size, model.eos_token_ids
        )
        speculative = model.capabilities.speculative  # the workers' flags are the truth
        cache_config = self._cache_config(cache_info)
        offload = offload_index_for(self.args.model_config(), cache_config, cache_info, model)
        scheduler = Scheduler(
            config,
            cache_config,
            cache_info.num_device_blocks,
            cache_info.num_cpu_blocks,
            structured,
            num_lookahead_tokens=speculative.num_lookahead_tokens if speculative else 0,
            max_loras=model.capabilities.max_loras,
            pooler=model.capabilities.pooler,
        )
        scheduler.kv.use_offload(offload)
        _warn_if_the_cache_caps(
            config.max_model_len, scheduler.max_model_len, cache_info, speculative
        )
        info = served_model_info(
            self.args.served_model_name, model, scheduler.max_model_len, cache_info
        )
        return EngineCore(scheduler, executor), info

    def _check_model(self, model: ModelInfo) -> ModelInfo:
        if self.model is not None and model.model_fields() != self.model.model_fields():
            raise ValueError(
                f"the workers now run {model.model} ({model.model_fields()}), "
                f"not {self.model.model}: restart the scheduler"
            )
        check_with_model(self.args, model)
        self.model = model
        return model

    def _cache_config(self, cache_info: CacheInfo) -> CacheConfig:
        """The engine's cache settings with the block size the workers laid out and the
        model's KV cache groups (their windows: what the scheduler may free)."""
        cache_config = self.args.cache_config()
        groups = self.model.kv_cache_groups if self.model is not None else (0,)
        cache_config = replace(cache_config, kv_cache_groups=groups)
        if cache_config.block_size == cache_info.block_size:
            return cache_config
        logger.warning(
            "block_size %d differs from the worker's %d: using the worker's",
            cache_config.block_size,
            cache_info.block_size,
        )
        return replace(cache_config, block_size=cache_info.block_size)


def _warn_if_the_cache_caps(
    asked: int, capped: int, cache: CacheInfo, speculative: SpeculativeConfig | None
) -> None:
    """A sequence can never outgrow the KV cache: say so once when that caps max_model_len
    (the frontends are told the capped length, so longer prompts get a clear error)."""
    if capped >= asked:
        return
    draft = " (a draft model's cache shares each block's bytes)" if speculative else ""
    logger.warning(
        "the KV cache holds %d tokens (%d blocks of %d)%s: max_model_len is %d, not %d; "
        "give the cache more memory (kv_cache_memory / --kv-cache-memory) for longer sequences",
        capped,
        cache.num_device_blocks,
        cache.block_size,
        draft,
        capped,
        asked,
    )


def served_model_info(
    served_name: str | None,
    model: ModelInfo,
    max_model_len: int,
    cache: CacheInfo,
) -> ServedModelInfo:
    """What the frontends are told about the model an engine core serves; `max_model_len`
    is the scheduler's (the configured length, capped by what the KV cache holds)."""
    return ServedModelInfo(
        model=served_name or model.model,
        max_model_len=max_model_len,
        vocab_size=model.vocab_size,
        eos_token_ids=model.eos_token_ids,
        block_size=cache.block_size,
        architecture=model.architecture,
        dtype=model.dtype,
        num_device_blocks=cache.num_device_blocks,
        quantization=model.quantization,
        weight_bytes=model.weight_bytes,
        capabilities=model.capabilities,
    )
