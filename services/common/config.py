"""Engine configuration: frozen dataclasses validated in __post_init__.

Values derived at run time (the number of KV blocks a worker can hold) live in their
own result objects and are never written back here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from services.common.kv_cache_dtype import KV_CACHE_DTYPES
from services.common.lora_config import LoRAConfig
from services.common.pooler_config import PoolerConfig
from services.common.speculative_config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Where the CPU worker's intra-op threads run: auto pins one per physical core
# (services/worker/cpu_tuning.py), none leaves them where the OS puts them.
CPU_THREADS_BIND = ("auto", "none")
DEVICES = ("auto", "cpu", "cuda")
# vLLM's runners: generate (sample tokens) or pooling (embeddings: one pooled vector per
# prompt); auto: pooling for base-model checkpoints (architectures "*Model") and
# sentence-transformers folders, else generate.
RUNNERS = ("auto", "generate", "pooling")
# Weight-only quantization (vLLM's names): gguf keeps a GGUF file's blocks (the default for
# .gguf models at dtype auto); int8 / int4 quantize a float checkpoint at load; none runs
# a GGUF file de-quantized.
QUANTIZATIONS = ("gguf", "int8", "int4", "none")
INT4_GROUP_SIZES = (32, 128)
# uni: the worker in this process; mp: the engine starts tp * pp local worker processes;
# external: workers started by someone else, at the given --worker addresses; ray: Ray
# places tp * pp worker processes (one actor per rank; needs pagestream[ray]).
DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "external", "ray")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(value: int | float | str, name: str = "size") -> int:
    """Parse a byte count such as 4294967296, "4GiB", "512MiB" or "1.5GB"."""
    if isinstance(value, int | float):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{name} must be a byte count such as 4GiB or 512MiB, got {value!r}.")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")


def _one_of(name: str, value: object, allowed: tuple[object, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}.")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; CPU default is 4 GiB (see resolved_kv_bytes)
    swap_space: int = 4 * 1024**3  # bytes of CPU swap pool
    cache_dtype: str = "auto"
    # KV offload tiers (DESIGN.md section 10): full blocks are kept, beside the cache, in
    # host memory (kv_offload_host_bytes, 0: no host tier) and in files under
    # kv_offload_dir (bounded by kv_offload_bytes, LRU), keyed by block hash and the
    # model's identity; a prefix lookup reads them back before recomputing.
    kv_offload_dir: str | None = None
    kv_offload_bytes: int = 8 * 1024**3
    kv_offload_host_bytes: int = 0
    # Not a flag: the workers' KV cache groups (layers sharing one block table), as they
    # describe the model: per group the window its layers attend within (0: full
    # attention); a windowed group's blocks outside the window are freed.
    kv_cache_groups: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(
                f"block_size must be a power of two in [1, 256], got {self.block_size}."
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}.")
        _one_of("cache_dtype", self.cache_dtype, KV_CACHE_DTYPES)
        for name in ("kv_offload_bytes", "kv_offload_host_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {getattr(self, name)}.")

    @property
    def kv_offload_enabled(self) -> bool:
        """A tier is on: a directory with room, or host memory for it."""
        disk = self.kv_offload_dir is not None and self.kv_offload_bytes > 0
        return disk or self.kv_offload_host_bytes > 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Cap on prefill tokens one request may take in a step (0: no cap beyond the budget).
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    # New requests are refused (overload) while this many wait; 0: no bound.
    max_waiting_requests: int = 0

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        if self.max_waiting_requests < 0:
            raise ValueError(
                f"max_waiting_requests must be >= 0 (0: no bound), got {self.max_waiting_requests}."
            )
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off, "
                "or long prompts could never be scheduled."
            )
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _one_of("policy", self.policy, SCHEDULING_POLICIES)


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own context length
    attention_backend: str = "auto"
    # the torch modules op by op: on the CPU no native decoder step (services/worker/native_step.py)
    enforce_eager: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu
    cpu_threads_bind: str = "auto"  # CPU_THREADS_BIND
    quantization: str | None = None  # None: gguf for .gguf files at dtype auto, else none
    quantization_group_size: int = 128  # int4's group of input features
    # a mixture of experts' whole experts on each TP rank (vLLM's name), else every expert
    # split over the ranks like the dense MLP
    enable_expert_parallel: bool = False
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)
    lora: LoRAConfig | None = None  # LoRA adapters (None: off)
    runner: str = "auto"  # RUNNERS (the worker resolves auto from the model's files)
    # the pooling runner's choices (unset fields: the model's own)
    pooler: PoolerConfig = field(default_factory=PoolerConfig)

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        if self.quantization is not None:
            _one_of("quantization", self.quantization, QUANTIZATIONS)
        _one_of("quantization_group_size", self.quantization_group_size, INT4_GROUP_SIZES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _one_of("device", self.device, DEVICES)
        _one_of("cpu_threads_bind", self.cpu_threads_bind, CPU_THREADS_BIND)
        _one_of("runner", self.runner, RUNNERS)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: uni at world size 1, else mp

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)
        if self.distributed_executor_backend is not None:
            _one_of(
                "distributed_executor_backend",
                self.distributed_executor_backend,
                DISTRIBUTED_EXECUTOR_BACKENDS,
            )
        if self.backend == "uni" and self.world_size > 1:
            raise ValueError(
                "--distributed-executor-backend uni runs one worker in this process, but "
                f"--tensor-parallel-size {self.tensor_parallel_size} x "
                f"--pipeline-parallel-size {self.pipeline_parallel_size} needs "
                f"{self.world_size} workers: use mp, ray or external."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"
