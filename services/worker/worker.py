"""Worker: the in-process actor behind the Worker service (Describe, InitializeCache,
Execute, Reset). Its gRPC servicer wraps these methods one to one."""

from __future__ import annotations

import logging

import torch

from services.common.config import CacheConfig, ModelConfig
from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.common.worker_info import CacheInfo, ModelInfo
from services.worker.cache_engine import (
    CacheEngine,
    num_blocks_for_budget,
    profile_num_gpu_blocks,
)
from services.worker.cpu_tuning import tune_malloc
from services.worker.dummy_forward import dummy_forward
from services.worker.input_batch import InputBatch
from services.worker.model_loader import load_model, resolve_device, resolve_dtype
from services.worker.model_runner import ModelRunner
from services.worker.sampler import Sampler

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 4 * 1024**3


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.max_num_seqs = 256
        self.max_num_batched_tokens = 2048
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        if self.device.type == "cpu":
            tune_malloc()
        torch.manual_seed(model_config.seed)
        self.model = load_model(model_config, self.device, self.dtype)
        self.runner: ModelRunner | None = None
        self.cache_info: CacheInfo | None = None

    def describe(self) -> ModelInfo:
        model = self.model
        max_len = self.model_config.max_model_len or model.max_model_len or 2048
        return ModelInfo(
            model=self.model_config.model,
            architecture=type(model).__name__,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            vocab_size=model.vocab_size,
            eos_token_ids=tuple(model.eos_token_ids),
            max_model_len=max_len,
        )

    def initialize_cache(
        self,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
    ) -> CacheInfo:
        """Size the KV cache (profiling on CUDA, an explicit budget on CPU) and allocate it.

        The scheduler's limits size the profiling pass and the per-request tables.
        """
        info = self.describe()
        max_model_len = max_model_len or info.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        spec = self.model.kv_cache_spec
        block_size = self.cache_config.block_size
        bytes_per_block = spec.bytes_per_block(block_size)
        num_gpu_blocks = self._num_device_blocks(bytes_per_block)
        num_cpu_blocks = self.cache_config.swap_space // bytes_per_block
        cache_engine = CacheEngine(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            spec.dtype,
            self.device,
        )
        input_batch = InputBatch(
            block_size,
            self.max_num_seqs,
            max_model_len,
            info.vocab_size,
            self.model.eos_token_id,
            self.device,
        )
        self.runner = ModelRunner(
            self.model, cache_engine, input_batch, Sampler(self.model_config.seed)
        )
        self.cache_info = CacheInfo(num_gpu_blocks, num_cpu_blocks, block_size, bytes_per_block)
        logger.info(
            "KV cache: %d device blocks, %d CPU blocks of %d tokens (%.1f MiB each)",
            num_gpu_blocks,
            num_cpu_blocks,
            block_size,
            bytes_per_block / 2**20,
        )
        return self.cache_info

    def _num_device_blocks(self, bytes_per_block: int) -> int:
        explicit = self.cache_config.kv_cache_memory
        if self.device.type != "cuda" or explicit is not None:
            return num_blocks_for_budget(explicit or DEFAULT_CPU_KV_BYTES, bytes_per_block)
        return profile_num_gpu_blocks(
            self._dummy_forward,
            bytes_per_block,
            self.cache_config.gpu_memory_utilization,
            self.device,
        )

    def _dummy_forward(self) -> None:
        dummy_forward(
            self.model,
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.cache_config.block_size,
            self.device,
        )

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if self.runner is None:
            raise RuntimeError("initialize_cache() must run before execute().")
        return self.runner.execute(plan)

    def reset(self) -> None:
        """Drop every request's state (the scheduler restarted); the cache stays allocated."""
        if self.runner is not None:
            self.runner.input_batch = InputBatch(
                self.cache_config.block_size,
                self.max_num_seqs,
                self.runner.input_batch.max_model_len,
                self.model.vocab_size,
                self.model.eos_token_id,
                self.device,
            )
