"""EngineArgs: vLLM's engine argument names, turned into the validated configs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from services.common.compatibility import check_compatibility
from services.common.config import (
    ATTENTION_BACKENDS,
    CPU_THREADS_BIND,
    DEFAULT_MODEL,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    DTYPES,
    INT4_GROUP_SIZES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    RUNNERS,
    SCHEDULING_POLICIES,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_size,
)
from services.common.flags import flag
from services.common.kv_cache_dtype import KV_CACHE_DTYPES
from services.common.lora_config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoRAConfig
from services.common.pooler_config import PoolerConfig
from services.common.speculative_config import SpeculativeConfig
from services.scheduler.kv_events_access import DEFAULT_KV_EVENTS, KV_EVENTS_MODES

GIB = 1024**3
# The serving roles' bound on waiting requests (--max-waiting-requests): four batches of the
# default max_num_seqs. Past it a request would wait minutes behind the queue, longer than
# most clients wait, so refusing it at once (429, the client retries or goes elsewhere) is
# kinder; memory stays bounded too. The Python API (LLM, AsyncEngine) keeps no bound by
# default: an offline batch queues all of its prompts by design.
SERVING_MAX_WAITING_REQUESTS = 1024


# Per device: (max_num_batched_tokens, long_prefill_token_threshold) when not given.
# CPU: 2048 / 256 keeps the offline throughput of an uncapped 2048 and cuts the
# inter-token latency tail under load: a step carries at most 256 prompt tokens of each
# request, so decoding requests wait for one long prompt's chunk less.
CONVERTS = ("auto", "none", "embed")  # vLLM's --convert values this engine runs
STEP_DEFAULTS = {"cpu": (2048, 256), "cuda": (2048, 0)}


@dataclass
class EngineArgs:
    """vLLM's engine arguments; each field is also its `--flag` (services/common/flags.py)."""

    model: str = DEFAULT_MODEL  # positional on the command line
    mmproj: str | None = flag(
        None,
        "llama.cpp's vision projector file beside a .gguf model (llama-server's --mmproj): "
        "LLaVA (projector type mlp) and Idefics3 / SmolVLM (idefics3); the pair is converted "
        "once into an HF VLM folder in the cache, which then stands for the model",
    )
    dtype: str = flag(
        ModelConfig.dtype,
        "auto: bfloat16 on CUDA and on CPUs with native bf16 (avx512_bf16 or AMX; float32 "
        "residuals and norms), float32 on other CPUs",
        choices=DTYPES,
    )
    seed: int = flag(
        ModelConfig.seed, "the seed of the weights' random parts and of unseeded sampling"
    )
    device: str = flag(ModelConfig.device, "auto: cuda when available, else cpu", choices=DEVICES)
    cpu_threads_bind: str = flag(
        ModelConfig.cpu_threads_bind,
        "the CPU worker's intra-op threads: auto pins one to each physical core (of the "
        "rank's share under mp; only when the threads fill the process's CPUs), none leaves "
        "them to the OS (vLLM's VLLM_CPU_OMP_THREADS_BIND auto / nobind)",
        choices=CPU_THREADS_BIND,
    )
    max_model_len: int | None = flag(
        None, "the longest sequence (prompt + output) served (default: the model's)"
    )
    block_size: int = flag(CacheConfig.block_size, "tokens per KV-cache block")
    max_num_seqs: int = flag(SchedulerConfig.max_num_seqs, "sequences in one step at most")
    max_num_batched_tokens: int | None = flag(
        None,
        "tokens in one step at most (default 2048; without chunked prefill at least max_model_len)",
    )
    enable_prefix_caching: bool = flag(
        CacheConfig.enable_prefix_caching, "share the KV blocks of equal prefixes"
    )
    enable_chunked_prefill: bool = flag(
        SchedulerConfig.enable_chunked_prefill, "split long prompts over several steps"
    )
    long_prefill_token_threshold: int | None = flag(
        None,
        "prefill tokens one request may take per step (default: 256 on the CPU, no cap on "
        "CUDA; 0: no cap)",
    )
    preemption_mode: str = flag(
        SchedulerConfig.preemption_mode,
        "what a preempted sequence loses: its blocks (recompute) or nothing (swap to the CPU pool)",
        choices=PREEMPTION_MODES,
    )
    scheduling_policy: str = flag(
        SchedulerConfig.policy,
        "waiting order: arrival (fcfs) or the request's priority",
        choices=SCHEDULING_POLICIES,
    )
    swap_space: float = flag(CacheConfig.swap_space / GIB, "GiB of CPU swap space")
    kv_cache_memory: int | str | None = flag(
        None, "KV cache bytes on the CPU, e.g. 4GiB (default 4 GiB)"
    )
    kv_offload_dir: str | None = flag(
        None,
        "a directory where full KV blocks are kept across evictions, unloads and restarts "
        "(keyed by block hash and the model's identity; a prefix hit reads them back)",
    )
    kv_offload_bytes: int | str = flag(
        "8GiB", "--kv-offload-dir's bound, e.g. 8GiB (least recently used blocks go first)"
    )
    kv_offload_host_bytes: int | str = flag(
        0, "host memory for a KV offload tier in front of the directory, e.g. 2GiB (0: none)"
    )
    kv_cache_dtype: str = flag(
        CacheConfig.cache_dtype,
        "the KV cache's dtype (auto: the model's); q8_0 (alias int8): llama.cpp's int8 with a "
        "float16 scale per 32 values, 34 bytes per 32 (CPU attention backends); fp8, "
        "fp8_e4m3, fp8_e5m2: float8 (triton backend)",
        choices=KV_CACHE_DTYPES,
    )
    gpu_memory_utilization: float = flag(
        CacheConfig.gpu_memory_utilization,
        "CUDA: the fraction of device memory weights, activations and the cache may use",
    )
    attention_backend: str = flag(
        ModelConfig.attention_backend,
        "paged attention kernels: torch, cpu (C++) or triton",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = flag(
        ModelConfig.enforce_eager,
        "run the model's torch modules op by op (vLLM's eager mode): on the CPU the native "
        "decoder step (one C++ call per step over prepacked weights) is not used, the "
        "modules run with packed linears and --attention-backend's kernels; for comparing "
        "the two paths or working around the native one (no CUDA graphs are captured, so "
        "CUDA runs the same either way)",
    )
    quantization: str | None = flag(
        None,
        "weight-only quantization: gguf runs a .gguf file's Q8_0 / Q4_0 / Q4_1 / Q4_K / "
        "Q5_K / Q6_K blocks as they are (the default for .gguf models at --dtype auto); int8 "
        "(per output channel) or int4 (groups, --quantization-group-size) quantize a float "
        "checkpoint at load; none runs a .gguf file de-quantized",
        short="-q",
        choices=QUANTIZATIONS,
    )
    quantization_group_size: int = flag(
        ModelConfig.quantization_group_size,
        "int4: input features that share a scale and zero point",
        choices=INT4_GROUP_SIZES,
    )
    served_model_name: str | None = flag(None, "the model name clients use")
    generation_config: str = flag(
        "auto",
        "default sampling values for requests that leave them unset: 'auto' (the model's "
        "generation_config.json), 'vllm' (vLLM's defaults), or a folder with the file",
    )
    tensor_parallel_size: int = flag(
        ParallelConfig.tensor_parallel_size, "ranks per stage", short="-tp"
    )
    enable_expert_parallel: bool = flag(
        ModelConfig.enable_expert_parallel,
        "mixture-of-experts models: each tensor-parallel rank holds whole experts (an "
        "even share of them) instead of a slice of every expert",
    )
    pipeline_parallel_size: int = flag(
        ParallelConfig.pipeline_parallel_size, "pipeline stages", short="-pp"
    )
    distributed_executor_backend: str | None = flag(
        None,
        "how worker ranks are started: uni (this process, world size 1), mp (local "
        "processes; the default for world size > 1), external (given --worker addresses), "
        "ray (Ray places one worker per rank: a local Ray, or the cluster at $RAY_ADDRESS; "
        "pip install 'pagestream[ray]')",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
    )
    async_scheduling: bool = flag(
        False, "plan the next step while the current one runs (two plans in flight)"
    )
    # The Python API (LLM, AsyncEngine) keeps no bound by default: an offline batch queues
    # all of its prompts by design. The serving roles default to SERVING_MAX_WAITING_REQUESTS.
    max_waiting_requests: int = flag(
        0,
        "refuse new requests at once (HTTP 429, gRPC RESOURCE_EXHAUSTED) while this many "
        f"wait to be scheduled; 0: no bound (default {SERVING_MAX_WAITING_REQUESTS}; "
        "`generate` queues every prompt)",
        cli_default=SERVING_MAX_WAITING_REQUESTS,
    )
    kv_events: str = flag(
        DEFAULT_KV_EVENTS,
        "who may watch the scheduler's prefix-cache events (the block hashes of every "
        "client's prompts; a data-parallel frontend routes by them): authenticated (peers on "
        "this host, and peers with a client certificate from --tls-ca), any (every peer that "
        "reaches the port: only where a network policy admits just the frontends), off",
        choices=KV_EVENTS_MODES,
    )

    speculative_config: str | Mapping | None = flag(
        None,
        "speculative decoding, vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 3}\'; "disable_by_batch_size": no proposals while a step '
        "runs that many sequences (default 32)",
    )
    enable_lora: bool = flag(False, "serve LoRA adapters over the base model (--lora-modules)")
    max_loras: int = flag(DEFAULT_MAX_LORAS, "LoRA adapters in one step at most")
    max_lora_rank: int = flag(DEFAULT_MAX_LORA_RANK, "the largest LoRA rank served")
    max_cpu_loras: int | None = flag(
        None, "LoRA adapters each worker keeps loaded in host memory (default: max_loras)"
    )
    runner: str = flag(
        ModelConfig.runner,
        "generate (sample tokens) or pooling (embeddings: /v1/embeddings, LLM.embed); auto: "
        "pooling for base-model checkpoints (architectures '*Model') and sentence-transformers "
        "folders, else generate",
        choices=RUNNERS,
    )
    convert: str = flag(
        "auto",
        "vLLM's model conversion: embed runs a generative checkpoint as an embedding model "
        "(implies --runner pooling); none and auto leave the runner to choose",
        choices=CONVERTS,
    )
    pooler_config: str | Mapping | None = flag(
        None,
        "the pooling runner's pooler, vLLM's JSON: "
        '\'{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true, "dimensions": N}\'; '
        "unset fields come from the model's sentence-transformers files (else LAST, "
        "normalized); dimensions: the default output size of a Matryoshka model",
    )

    def __post_init__(self) -> None:
        # llama.cpp's pair: from here on its VLM folder is the model, as every role sees it;
        # clients keep the name given (the text GGUF's), not the cache folder's
        if self.mmproj is not None:
            from services.common.model_source import resolve_pair

            self.served_model_name = self.served_model_name or self.model
            self.model, self.mmproj = str(resolve_pair(self.model, self.mmproj)), None
        if self.max_waiting_requests is None:  # the Python API's "no bound", spelled None
            self.max_waiting_requests = 0
        SpeculativeConfig.parse(self.speculative_config)  # a bad config fails here, by name
        PoolerConfig.parse(self.pooler_config)
        check_compatibility(self)  # combinations the flags alone refuse, by name
        self.lora_config()

    def resolved_runner(self) -> str:
        """--runner, with --convert embed's pooling."""
        return "pooling" if self.convert == "embed" else self.runner

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            model=self.model,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            device=self.device,
            cpu_threads_bind=self.cpu_threads_bind,
            quantization=self.quantization,
            quantization_group_size=self.quantization_group_size,
            enable_expert_parallel=self.enable_expert_parallel,
            speculative=SpeculativeConfig.parse(self.speculative_config),
            lora=self.lora_config(),
            runner=self.resolved_runner(),
            pooler=PoolerConfig.parse(self.pooler_config),
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
            kv_offload_dir=self.kv_offload_dir,
            kv_offload_bytes=parse_size(self.kv_offload_bytes, "kv_offload_bytes"),
            kv_offload_host_bytes=parse_size(self.kv_offload_host_bytes, "kv_offload_host_bytes"),
        )

    def scheduler_config(
        self, model_max_len: int, device: str = "cpu", whole_prompts: bool = False
    ) -> SchedulerConfig:
        """The scheduler's limits once the model's own context length and the workers'
        device are known (the step budget's defaults differ by device, STEP_DEFAULTS).
        An encoder (`whole_prompts`: each prompt runs whole in one step) defaults to a step
        that holds its longest prompt and to no long-prefill cap: nothing decodes beside
        it, and a capped step would refuse every prompt longer than the cap."""
        max_model_len = self.max_model_len or model_max_len
        if self.max_model_len and self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's context "
                f"length ({model_max_len})."
            )
        budget, long_prefill = STEP_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
        batched = self.max_num_batched_tokens
        if batched is None:
            chunked = self.enable_chunked_prefill and not whole_prompts
            batched = budget if chunked else max(budget, max_model_len)
        if self.long_prefill_token_threshold is not None:
            long_prefill = self.long_prefill_token_threshold
        elif not self.enable_chunked_prefill or whole_prompts:
            long_prefill = 0
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill,
            preemption_mode=self.preemption_mode,
            policy=self.scheduling_policy,
            max_waiting_requests=self.max_waiting_requests,
        )

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        return cls(**kwargs)
