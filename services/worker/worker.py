"""Worker: the in-process actor behind the Worker service (Describe, InitializeCache,
Execute, Reset). Its gRPC servicer wraps these methods one to one."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

import torch

from services.common import kv_cache_dtype
from services.common.config import CacheConfig, ModelConfig
from services.common.convert.plan_limits import PlanLimits
from services.common.kv_offload_identity import kv_offload_identity
from services.common.model_capabilities import ModelCapabilities
from services.common.rank_info import RankInfo
from services.common.runner_output import RunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.common.speculative_config import SpeculativeConfig
from services.common.worker_info import CacheInfo, ModelInfo
from services.worker.cache_engine import (
    CacheEngine,
    num_blocks_for_budget,
    profile_num_gpu_blocks,
)
from services.worker.cpu_tuning import pin_threads, tune_malloc
from services.worker.dummy_forward import dummy_forward
from services.worker.input_batch import InputBatch
from services.worker.kv_offload.kv_offload_store import KVOffloadStore
from services.worker.lora.lora_manager import LoRAManager
from services.worker.model_loader import (
    LoadedModel,
    load,
    load_model,
    resolve_device,
    resolve_dtype,
)
from services.worker.model_runner import ModelRunner
from services.worker.models.causal_lm import CausalLM
from services.worker.models.kv_cache_spec import KVCacheGroups, KVCacheSpec
from services.worker.parallel_state import DEFAULT_TIMEOUT_S, init_parallel_state
from services.worker.pooler import Pooler
from services.worker.sampler import Sampler
from services.worker.spec_decode.draft_proposer import DraftModelProposer
from services.worker.spec_decode.ngram_proposer import NgramProposer
from services.worker.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 4 * 1024**3


class Worker:
    """One rank: `rank` says where it sits in its worker group (default: alone). A rank of
    a group joins the group's process groups at `dist_init_method` before it loads its
    shard of the model (so every rank must be started within `dist_timeout_s`)."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        rank: RankInfo | None = None,
        dist_init_method: str | None = None,
        dist_timeout_s: float = DEFAULT_TIMEOUT_S,
        local_rank: int | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.rank = rank or RankInfo()
        # The scheduler's limits, once a cache request brings them (profile_cache).
        self.max_num_seqs: int | None = None
        self.max_num_batched_tokens: int | None = None
        self.device = _rank_device(resolve_device(model_config.device), local_rank)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        if self.device.type == "cpu":
            tune_malloc()
        if self.rank.world_size > 1:
            if not dist_init_method:
                raise ValueError("a worker group rank needs --dist-init-method (or MASTER_ADDR)")
            init_parallel_state(self.rank, dist_init_method, self.device, dist_timeout_s)
        torch.manual_seed(model_config.seed)
        self.loaded = load(model_config, self.device, self.rank)
        self.model = self.loaded.model
        self.pooler = _pooler(self.loaded)
        self.draft_model = self._load_draft(model_config.speculative)
        lora = model_config.lora
        self.lora = None if lora is None else LoRAManager(self.model, lora, self.device)
        self.runner: ModelRunner | None = None
        self.cache_info: CacheInfo | None = None
        self._pinned_for: int | None = None  # the thread whose intra-op team is pinned
        # --kv-cache-dtype against the models' head_dims and attention backend: a bad pair
        # fails the load, not the first cache request
        for model in (self.model, self.draft_model):
            if model is not None:
                self._cache_spec(model)

    def _load_draft(self, speculative: SpeculativeConfig | None) -> CausalLM | None:
        """The draft model of speculative decoding (same device and dtype as the target),
        checked to share the target's vocabulary."""
        if speculative is None or speculative.method != "draft_model":
            return None
        draft_config = dataclasses.replace(
            self.model_config, model=speculative.model, max_model_len=None, speculative=None
        )
        draft = load_model(draft_config, self.device)
        if draft.vocab_size != self.model.vocab_size:
            raise ValueError(
                f"speculative_config.model {speculative.model!r} has a vocabulary of "
                f"{draft.vocab_size} tokens, the target {self.model.vocab_size}: a draft "
                "model must share the target's tokenizer"
            )
        logger.info("speculative decoding: draft model %s", speculative.model)
        return draft

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The model's cache layout in the cache dtype (--kv-cache-dtype; auto: the model's)."""
        return self._cache_spec(self.model)

    @property
    def kv_cache_groups(self) -> KVCacheGroups:
        """How the model's layers share block tables: the model's grouping, or one group
        of full attention beside a draft model (it reads the same blocks with its own
        layers, so nothing is freed)."""
        if self.draft_model is None:
            return self.model.kv_cache_groups
        return KVCacheGroups.single(self.model.num_layers)

    def _cache_spec(self, model: CausalLM) -> KVCacheSpec:
        spec = model.kv_cache_spec
        if self.draft_model is not None:
            spec = dataclasses.replace(spec, layer_slots=())
        name = self.cache_config.cache_dtype
        if name == "auto":
            return spec
        kv_cache_dtype.check_backend(name, model.attention_ops.name)
        if kv_cache_dtype.is_q8_0(name):
            return dataclasses.replace(spec, dtype=torch.uint8, q8_0=True)
        if kv_cache_dtype.is_fp8(name):
            return dataclasses.replace(
                spec, dtype=getattr(torch, kv_cache_dtype.FP8_TORCH_NAMES[name])
            )
        return dataclasses.replace(spec, dtype=resolve_dtype(name, self.device))

    def _bytes_per_block(self) -> int:
        """A block's bytes over every layer, the draft model's included."""
        block_size = self.cache_config.block_size
        total = self.kv_cache_spec.bytes_per_block(block_size)
        if self.draft_model is not None:
            total += self._cache_spec(self.draft_model).bytes_per_block(block_size)
        return total

    def describe(self) -> ModelInfo:
        model = self.model
        max_len = self.model_config.max_model_len or model.max_model_len or 2048
        if self.draft_model is not None and self.draft_model.max_model_len:
            max_len = min(max_len, self.draft_model.max_model_len)
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
            rank=self.rank.rank,
            world_size=self.rank.world_size,
            tensor_parallel_size=self.rank.tensor_parallel_size,
            pipeline_parallel_size=self.rank.pipeline_parallel_size,
            quantization=self.loaded.quantization,
            weight_bytes=self.loaded.weight_bytes,
            capabilities=ModelCapabilities(
                can_generate=self.model.can_generate,
                pooler=self.pooler.config if self.pooler else None,
                lora=self.lora.config if self.lora else None,
                lora_targets=self.lora.targets if self.lora else None,
                speculative=self.model_config.speculative,
            ),
            kv_cache_groups=self.kv_cache_groups.windows,
        )

    def initialize_cache(
        self, max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int
    ) -> CacheInfo:
        """One rank alone: size the KV cache (profiling on CUDA, an explicit budget on
        CPU) and allocate it. The scheduler's limits size the profiling pass and the
        per-request tables."""
        profiled = self.profile_cache(max_model_len, max_num_seqs, max_num_batched_tokens)
        return self.allocate_cache(
            max_model_len,
            max_num_seqs,
            max_num_batched_tokens,
            profiled.num_device_blocks,
            profiled.num_cpu_blocks,
        )

    def profile_cache(
        self, max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int
    ) -> CacheInfo:
        """How many blocks this rank could hold; allocates nothing (worker groups take
        the minimum over their ranks and then allocate_cache on every rank)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        block_size = self.cache_config.block_size
        bytes_per_block = self._bytes_per_block()
        num_device_blocks = self._num_device_blocks(bytes_per_block)
        num_cpu_blocks = self.cache_config.swap_space // bytes_per_block
        if self.model.bidirectional:  # an encoder reads no cache: blocks only count tokens
            most = self._encoder_blocks(max_model_len, max_num_seqs, block_size)
            num_device_blocks, num_cpu_blocks = (
                min(num_device_blocks, most),
                min(num_cpu_blocks, most),
            )
        return CacheInfo(num_device_blocks, num_cpu_blocks, block_size, bytes_per_block)

    def _encoder_blocks(self, max_model_len: int | None, max_num_seqs: int, block_size: int):
        """What an encoder's scheduler can ever hold: every running prompt at its longest
        (its cache is bookkeeping only; a budget's worth of tiny blocks would take seconds
        and gigabytes to allocate for nothing)."""
        longest = max_model_len or self.model.max_model_len or block_size
        return max_num_seqs * -(-int(longest) // block_size) + 1

    def allocate_cache(
        self,
        max_model_len: int | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
    ) -> CacheInfo:
        """Allocate exactly num_device_blocks device and num_cpu_blocks swap blocks."""
        if num_device_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError(
                f"num_device_blocks must be >= 1 and num_cpu_blocks >= 0, "
                f"got {num_device_blocks} and {num_cpu_blocks}."
            )
        info = self.describe()
        max_model_len = max_model_len or info.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        block_size = self.cache_config.block_size
        bytes_per_block = self._bytes_per_block()
        cache_engine = self._cache_engine(self.kv_cache_spec, num_device_blocks, num_cpu_blocks)
        self.close()  # a runner this replaces: its KV offload files written first
        self.runner = ModelRunner(
            self.model,
            cache_engine,
            self._input_batch(max_model_len),
            Sampler(self.model_config.seed),
            self.rank,
            self._proposer(num_device_blocks, num_cpu_blocks),
            self.lora,
            self.pooler,
        )
        if self.cache_config.kv_offload_enabled and not self.model.bidirectional:
            self.runner.kv_offload = self._kv_offload_store(info)
        self.cache_info = CacheInfo(num_device_blocks, num_cpu_blocks, block_size, bytes_per_block)
        logger.info(
            "KV cache (rank %d): %d device blocks, %d CPU blocks of %d tokens (%.1f MiB each)",
            self.rank.rank,
            num_device_blocks,
            num_cpu_blocks,
            block_size,
            bytes_per_block / 2**20,
        )
        return self.cache_info

    def _kv_offload_store(self, info: ModelInfo) -> KVOffloadStore:
        """The KV offload tiers over every cache tensor this rank holds (a draft model's
        too: it shares the block tables), its files in this model's identity folder."""
        engines = [self.runner.cache_engine]
        proposer = self.runner.proposer
        if proposer is not None and proposer.cache_engine is not None:
            engines.append(proposer.cache_engine)
        config = self.cache_config
        identity = kv_offload_identity(self.model_config, config, info).for_rank(self.rank.rank)
        directory = None
        if config.kv_offload_dir is not None and config.kv_offload_bytes > 0:
            directory = identity.prepare(config.kv_offload_dir)
        logger.info("KV offload: identity %s, files in %s", identity.hex[:32], directory)
        caches = [cache for engine in engines for cache in engine.kv_caches]
        return KVOffloadStore(caches, identity.digest, directory, config.kv_offload_host_bytes)

    def close(self) -> None:
        """Write the KV offload tier's pending files and stop its threads."""
        if self.runner is not None and self.runner.kv_offload is not None:
            self.runner.kv_offload.close()
            self.runner.kv_offload = None

    def _cache_engine(self, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int) -> CacheEngine:
        return CacheEngine(
            spec, self.cache_config.block_size, num_blocks, num_cpu_blocks, self.device
        )

    def _proposer(self, num_blocks: int, num_cpu_blocks: int) -> Proposer | None:
        speculative = self.model_config.speculative
        if speculative is None:
            return None
        if self.draft_model is None:
            return NgramProposer(speculative)
        spec = self._cache_spec(self.draft_model)
        cache = self._cache_engine(spec, num_blocks, num_cpu_blocks)
        return DraftModelProposer(speculative, self.draft_model, cache)

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

    def _dummy_forward(self) -> None:  # every rank of a group at once (collectives)
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
        if self.device.type == "cpu" and self._pinned_for != threading.get_ident():
            # OpenMP keeps one thread team per calling thread: pin the one that runs steps
            pin_threads(self.model_config.cpu_threads_bind)
            self._pinned_for = threading.get_ident()
        return self.runner.execute(plan)

    @property
    def plan_limits(self) -> PlanLimits | None:
        """What a plan from the wire is checked against (None before initialize_cache)."""
        if self.runner is None:
            return None
        limits = self.runner.input_batch.limits
        return dataclasses.replace(limits, num_blocks=self.runner.cache_engine.num_blocks)

    def reset(self) -> None:
        """Drop every request's state (the scheduler restarted); the cache stays allocated."""
        if self.runner is not None:
            self.runner.link.wait()
            self.runner.input_batch = self._input_batch(self.runner.input_batch.max_model_len)

    def _input_batch(self, max_model_len: int) -> InputBatch:
        batch = InputBatch(
            self.cache_config.block_size,
            self.max_num_seqs,
            max_model_len,
            self.model.vocab_size,
            self.model.eos_token_id,
            self.device,
            self.kv_cache_groups.num_groups,
            getattr(self.model, "image_token_id", None),
        )
        batch.bidirectional_images = getattr(self.model, "bidirectional_images", False)
        batch.mrope_merge_size = getattr(self.model, "mrope_merge_size", None)
        return batch


def _rank_device(device: torch.device, local_rank: int | None) -> torch.device:
    """On CUDA each local rank takes its own device (LOCAL_RANK), as torchrun does."""
    if device.type != "cuda" or device.index is not None:
        return device
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank)


def _pooler(loaded: LoadedModel) -> Pooler | None:
    """The pooling runner's Pooler (None: the model generates; what it cannot run beside,
    speculation or LoRA, is refused by services/common/compatibility.py)."""
    if loaded.pooler is None:
        return None
    return Pooler(loaded.pooler, loaded.head)
