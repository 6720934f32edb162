"""EngineArgs: vLLM's engine argument names, turned into the validated configs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from services.common.config import (
    ATTENTION_BACKENDS,
    DEFAULT_MODEL,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    INT4_GROUP_SIZES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_size,
)

GIB = 1024**3
# The serving roles' bound on waiting requests (--max-waiting-requests): four batches of the
# default max_num_seqs. Past it a request would wait minutes behind the queue, longer than
# most clients wait, so refusing it at once (429, the client retries or goes elsewhere) is
# kinder; memory stays bounded too. The Python API (LLM, AsyncEngine) keeps no bound by
# default: an offline batch queues all of its prompts by design.
SERVING_MAX_WAITING_REQUESTS = 1024


# Per device: (max_num_batched_tokens, long_prefill_token_threshold) when not given.
# CPU: benchmarks/scheduler_sweep.py on a 2-core Zen 5 VM (SmolLM2-135M, float32; 32
# requests at concurrency 16 for the latencies): ITL p99 under load 473 ms at 2048 / no
# cap, 269 ms at 2048 / 256, 224 ms at 1024 / 128; offline on the quick workload's 64
# requests (medians of 2): 240, 240 and 228 output tok/s. 2048 / 256 keeps the
# throughput and cuts the tail: a step carries at most 256 prompt tokens of each request,
# so decoding requests wait for one long prompt's chunk less.
STEP_DEFAULTS = {"cpu": (2048, 256), "cuda": (2048, 0)}


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default 2048 (max_model_len without chunking)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # CPU: 256, CUDA: 0 (no cap)
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    swap_space: float = 4  # GiB of CPU swap space, as in vLLM
    kv_cache_memory: int | str | None = None  # bytes or "4GiB"; CPU default 4 GiB
    kv_cache_dtype: str = "auto"  # the model's dtype, or float32 / bfloat16 / float16
    gpu_memory_utilization: float = 0.9
    attention_backend: str = "auto"
    # Weight-only quantization: gguf (a .gguf file's blocks as they are; the default for
    # .gguf models at dtype auto), int8 / int4 (a float checkpoint quantized at load), none.
    quantization: str | None = None
    quantization_group_size: int = 128  # int4: input features per scale and zero point
    served_model_name: str | None = None
    # Sampling defaults: "auto" (the model's generation_config.json), "vllm" (none), a folder.
    generation_config: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # uni (world size 1) or mp by default
    async_scheduling: bool = False  # plan step t+1 while step t runs (2 plans in flight)
    # Refuse new requests while this many wait (0 or None: no bound; the CLI's serving
    # roles default to SERVING_MAX_WAITING_REQUESTS).
    max_waiting_requests: int | None = None

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )

    def to_cli_flags(self) -> list[str]:
        """These arguments back as CLI flags (only the ones that differ from the defaults;
        the model is not included)."""
        defaults = EngineArgs()
        flags: list[str] = []
        for f in fields(EngineArgs):
            value = getattr(self, f.name)
            if f.name == "model" or value == getattr(defaults, f.name) or value is None:
                continue
            name = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(name if value else "--no-" + f.name.replace("_", "-"))
            else:
                flags += [name, str(value)]
        return flags

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            model=self.model,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            device=self.device,
            quantization=self.quantization,
            quantization_group_size=self.quantization_group_size,
        )

    def cache_config(self) -> CacheConfig:
        kv_bytes = self.kv_cache_memory
        return CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory=None if kv_bytes is None else parse_size(kv_bytes, "kv_cache_memory"),
            swap_space=int(self.swap_space * GIB),
            cache_dtype=self.kv_cache_dtype,
        )

    def scheduler_config(self, model_max_len: int, device: str = "cpu") -> SchedulerConfig:
        """The scheduler's limits once the model's own context length and the workers'
        device are known (the step budget's defaults differ by device, CPU_STEP_DEFAULTS)."""
        max_model_len = self.max_model_len or model_max_len
        if self.max_model_len and self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's context "
                f"length ({model_max_len})."
            )
        budget, long_prefill = STEP_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = budget if self.enable_chunked_prefill else max(budget, max_model_len)
        if self.long_prefill_token_threshold is not None:
            long_prefill = self.long_prefill_token_threshold
        elif not self.enable_chunked_prefill:
            long_prefill = 0
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill,
            preemption_mode=self.preemption_mode,
            policy=self.scheduling_policy,
            max_waiting_requests=self.max_waiting_requests or 0,
        )

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """vLLM's flag names for the engine settings."""
        add = parser.add_argument
        add(
            "--dtype",
            default="auto",
            choices=DTYPES,
            help="auto: bfloat16 on CUDA and on CPUs with native bf16 (avx512_bf16 or AMX; "
            "float32 residuals and norms), float32 on other CPUs ($PAGESTREAM_CPU_DTYPE "
            "sets what auto means on the CPU)",
        )
        add("--seed", type=int, default=0)
        add("--device", default="auto", choices=("auto", "cpu", "cuda"))
        add("--max-model-len", type=int, default=None)
        add("--block-size", type=int, default=16)
        add("--max-num-seqs", type=int, default=256)
        add("--max-num-batched-tokens", type=int, default=None)
        add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
        add(
            "--long-prefill-token-threshold",
            type=int,
            default=None,
            help="prefill tokens one request may take per step (default: 256 on the CPU, "
            "no cap on CUDA; 0: no cap)",
        )
        add("--preemption-mode", default="recompute", choices=PREEMPTION_MODES)
        add("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
        add("--swap-space", type=float, default=4, help="GiB of CPU swap space")
        add("--kv-cache-memory", default=None, help="KV cache bytes on CPU, e.g. 4GiB")
        add(
            "--kv-cache-dtype",
            default="auto",
            choices=DTYPES,
            help="the KV cache's dtype (auto: the model's)",
        )
        add("--gpu-memory-utilization", type=float, default=0.9)
        add("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
        add(
            "--quantization",
            "-q",
            default=None,
            choices=QUANTIZATIONS,
            help="weight-only quantization: gguf runs a .gguf file's Q8_0 / Q4_0 / Q4_1 / "
            "Q4_K / Q5_K / Q6_K blocks as they are (the default for .gguf models at --dtype "
            "auto); int8 (per output channel) or int4 (groups, --quantization-group-size) "
            "quantize a float checkpoint at load; none runs a .gguf file de-quantized",
        )
        add(
            "--quantization-group-size",
            type=int,
            default=128,
            choices=INT4_GROUP_SIZES,
            help="int4: input features that share a scale and zero point",
        )
        add("--served-model-name", default=None, help="the model name clients use")
        add_generation_config_arg(parser)
        add("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks per stage")
        add("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages")
        add(
            "--distributed-executor-backend",
            default=None,
            choices=DISTRIBUTED_EXECUTOR_BACKENDS,
            help="how worker ranks are started: uni (this process, world size 1), mp (local "
            "processes; the default for world size > 1), external (given --worker addresses), "
            "ray (Ray places one worker per rank: a local Ray, or the cluster at $RAY_ADDRESS; "
            "pip install 'pagestream[ray]')",
        )
        add(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="plan the next step while the current one runs (two plans in flight)",
        )
        add(
            "--max-waiting-requests",
            type=int,
            default=SERVING_MAX_WAITING_REQUESTS,
            help="refuse new requests at once (HTTP 429, gRPC RESOURCE_EXHAUSTED) while this "
            f"many wait to be scheduled; 0: no bound (default {SERVING_MAX_WAITING_REQUESTS}; "
            "`generate` queues every prompt)",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**values)


def add_generation_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling values for requests that leave them unset: 'auto' (the model's "
        "generation_config.json), 'vllm' (vLLM's defaults), or a folder with the file",
    )
