"""The sections of `pagestream bench` (SECTIONS, in the report's order): each one's runner,
(args, folder, profile, workload, results) -> its results, where results.json keeps them,
and its report (a SectionReport, benchmarks/section_report.py; their words: reports.py).
benchmarks/cli.py parses the command line and runs them; benchmarks/report.py renders them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import reports
from benchmarks.results import load_average
from benchmarks.section_report import SectionReport

KV_DEFAULT = "2GiB"  # --kv-cache-memory's default: the sections that size their own cache


def listed(text: str | None, kind=str) -> tuple:
    """The comma-separated values of an option ("1,4,16" -> (1, 4, 16)); () for none."""
    return tuple(kind(item.strip()) for item in (text or "").split(",") if item.strip())


def given(**values) -> dict:
    """The options the command line gave (the others keep their dataclass's default)."""
    return {name: value for name, value in values.items() if value}


def run_routing(args, folder, profile, workload, results) -> dict:
    """serve -dp 2 under each router policy on conversations sharing system prompts; the
    KV cache per replica is sized by the routing profile unless --kv-cache-memory is given."""
    from transformers import AutoTokenizer

    from benchmarks.routing import POLICIES, ROUTING_PROFILES, RoutingOptions, run_routing

    policies = listed(args.policies)
    options = RoutingOptions(
        model=folder,
        profile=ROUTING_PROFILES[profile.name],
        policies=policies or POLICIES,
        kv_cache_memory=None if args.kv_cache_memory == KV_DEFAULT else args.kv_cache_memory,
        concurrency=args.concurrency,
        rounds=args.rounds,
    )
    return load_average(run_routing, AutoTokenizer.from_pretrained(folder), options)


def run_structured(args, folder, profile, workload, results) -> dict:
    """The same JSON-record prompts unconstrained and with a JSON schema, grammar compile
    times and mask fill per row (benchmarks/structured.py); --num-requests sets the number
    of prompts."""
    from transformers import AutoTokenizer

    from benchmarks.structured import STRUCTURED_PROFILES, StructuredOptions, run_structured

    structured = dataclasses.replace(
        STRUCTURED_PROFILES[profile.name],
        **given(num_prompts=args.num_requests, rounds=args.rounds),
    )
    options = StructuredOptions(
        model=folder, profile=structured, kv_cache_memory=args.kv_cache_memory
    )
    return load_average(run_structured, AutoTokenizer.from_pretrained(folder), options)


def run_precision(args, folder, profile, workload, results) -> dict:
    """bfloat16 against float32 on the profile's workload (benchmarks/precision.py):
    throughput side by side and greedy agreement."""
    from benchmarks.precision import PrecisionOptions, run_precision

    options = PrecisionOptions(folder, args.kv_cache_memory, **given(rounds=args.rounds))
    return run_precision(workload.requests, options)


def run_latency(args, folder, profile, workload, results) -> dict:
    """Time per output token at batch 1 / 4 / 16 by dtype, the weight-streaming limit and
    llama.cpp at batch 1 (benchmarks/latency.py)."""
    from benchmarks.latency import LatencyOptions, run_latency

    options = LatencyOptions(
        args.model,
        folder,
        args.kv_cache_memory,
        llamacpp=not args.no_llamacpp,
        **given(rounds=args.rounds),
    )
    return run_latency(options)


def run_quantized(args, folder, profile, workload, results) -> dict:
    """The model's own GGUF file kept quantized, against llama.cpp on the same file, and
    both runs' greedy agreement with float32 (benchmarks/quantized.py)."""
    from benchmarks.quantized import QuantizedOptions, run_quantized

    seqs = listed(args.llamacpp_seqs, int)[0]
    options = QuantizedOptions(args.model, args.kv_cache_memory, seqs)
    return run_quantized(workload.requests, options)


def run_speculative(args, folder, profile, workload, results) -> dict:
    """No speculation against ngram at each k and draft models (the target itself, a
    quantized GGUF file of the same model) at each batch, on a copy-heavy and the default
    workload (benchmarks/speculative.py); --num-requests and --rounds override its profile."""
    from transformers import AutoTokenizer

    from benchmarks.speculative import SPECULATIVE_PROFILES, SpeculativeOptions, run_speculative

    speculative = dataclasses.replace(
        SPECULATIVE_PROFILES[profile.name],
        **given(num_requests=args.num_requests, rounds=args.rounds),
    )
    options = SpeculativeOptions(
        model=folder,
        source_model=args.model,
        profile=speculative,
        workload_profile=profile,
        kv_cache_memory=args.kv_cache_memory,
        **given(
            batches=listed(args.batches, int),
            ks=listed(args.ks, int),
            draft=args.draft,
            draft_k=args.draft_k,
            prompt_lookup_min=args.prompt_lookup_min,
            prompt_lookup_max=args.prompt_lookup_max,
        ),
    )
    return load_average(run_speculative, AutoTokenizer.from_pretrained(folder), options)


def run_lora(args, folder, profile, workload, results) -> dict:
    """The base model alone against LoRA on with no adapter and with 1 / 4 / 16 random
    adapters of rank 8 and 64 (requests spread round-robin) on the default workload, and
    one chat at a time (benchmarks/lora.py); --num-requests and --rounds override its
    profile."""
    from transformers import AutoTokenizer

    from benchmarks.lora import LORA_PROFILES, LoRAOptions, run_lora

    lora = dataclasses.replace(
        LORA_PROFILES[profile.name],
        **given(num_requests=args.num_requests, rounds=args.rounds),
    )
    options = LoRAOptions(
        model=folder,
        profile=lora,
        workload_profile=profile,
        kv_cache_memory=args.kv_cache_memory,
        **given(
            ranks=listed(args.lora_ranks, int),
            adapter_counts=listed(args.lora_adapters, int),
            adapter_dir=args.lora_dir,
        ),
    )
    return load_average(run_lora, AutoTokenizer.from_pretrained(folder), options)


def run_embed(args, folder, profile, workload, results) -> dict:
    """Embeddings of the default corpus's passages: pagestream's pooling runner (float32,
    dtype auto, the GGUF file) against HF AutoModel in padded batches
    (benchmarks/embeddings.py); --num-requests sets the number of inputs."""
    from transformers import AutoTokenizer

    from benchmarks.embeddings import EMBED_PROFILES, EmbedOptions, run_embed, with_profile

    options = EmbedOptions(
        model=folder,
        source=args.model,
        profile=with_profile(EMBED_PROFILES[profile.name], args.num_requests, args.rounds),
        kv_cache_memory=args.kv_cache_memory,
    )
    return load_average(run_embed, AutoTokenizer.from_pretrained(folder), options)


def run_embed_encoder(args, folder, profile, workload, results) -> dict:
    """Random BERT-shaped encoders (--encoders, default minilm,bge-base): pagestream against
    sentence-transformers and llama-server (benchmarks/encoders.py);
    --num-requests sets the number of inputs."""
    from benchmarks.embeddings import with_profile
    from benchmarks.encoders import ENCODER_PROFILES, EncoderOptions, run_encoders

    options = EncoderOptions(
        shapes=listed(args.encoders) or ("minilm", "bge-base"),
        profile=with_profile(ENCODER_PROFILES[profile.name], args.num_requests, args.rounds),
        llamacpp=not args.no_llamacpp,
        llama_server=args.llama_server,
    )
    return load_average(run_encoders, options)


def run_serve_peer(args, folder, profile, workload, results) -> dict:
    """pagestream serve against llama-server at each concurrency (benchmarks/serve_peer.py)."""
    from transformers import AutoConfig

    from benchmarks.serve_peer import ServePeerOptions, run_serve_peer

    layouts = ("engine-core-process",)
    layouts += ("single-process",) * args.single_process + ("worker-process",) * args.worker_process
    options = ServePeerOptions(
        model=args.model,
        folder=folder,
        same_file=Path(args.model).suffix.lower() == ".gguf" and Path(args.model).is_file(),
        concurrencies=listed(args.concurrencies, int),
        llama_server=args.llama_server,
        layouts=layouts,
        **given(rounds=args.rounds),
    )
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    return run_serve_peer(options, vocab_size)


def run_throughput(args, folder, profile, workload, results) -> dict:
    from benchmarks.throughput import ThroughputOptions, run_throughput

    options = ThroughputOptions(
        model=folder,
        hf_batch_sizes=() if args.no_hf else profile.hf_batch_sizes,
        hf_continuous=not (args.no_hf or args.no_hf_continuous),
        kv_cache_memory=args.kv_cache_memory,
        extra_dtypes=("bfloat16",) if args.bf16 else (),
        llamacpp=_llamacpp_options(args) if args.llamacpp else None,
    )
    return run_throughput(workload.requests, options)


def _llamacpp_options(args):
    from benchmarks.llamacpp import LlamaCppOptions, import_llama_cpp

    try:
        import_llama_cpp()  # before minutes of other runs
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    return LlamaCppOptions(
        model=args.model,
        dtypes=("F32", "BF16") if args.bf16 else ("F32",),
        seqs=listed(args.llamacpp_seqs, int),
    )


def run_serving(args, folder, profile, workload, results) -> dict:
    from benchmarks.serving import ServingOptions, run_serving
    from benchmarks.workload import scaled

    requests = scaled(workload.requests[: profile.serve_num_requests], profile.serve_output_scale)
    options = ServingOptions(
        model=folder,
        rates=profile.serve_rates,
        split_services=not args.no_split,
        engine_flags=(
            "--kv-cache-memory",
            args.kv_cache_memory,
            "--no-enable-prefix-caching",  # runs reuse the prompts: no hits across runs
            "--dtype",
            "float32",  # as the HF baselines (auto is bfloat16 on CPUs with native bf16)
        ),
    )
    return run_serving(requests, options)


def run_memory(args, folder, profile, workload, results) -> dict:
    from benchmarks.memory import MemoryOptions, run_memory

    options = MemoryOptions(folder, profile, args.kv_cache_memory)
    throughput = results.get("throughput") or {}
    kv = throughput.get("runs", [{}])[0].get("kv_utilization")
    return run_memory(workload.requests, options, kv_utilization=kv)


def run_parallel(args, folder, profile, workload, results) -> dict:
    """Offline layouts side by side, then async scheduling on / off behind the servers;
    each part with the load average before and after it (the machine may be shared)."""
    from benchmarks.parallel import DEFAULT_LAYOUTS, Layout, ParallelOptions
    from benchmarks.parallel import run_parallel as run_layouts
    from benchmarks.serving import AsyncServingOptions, run_async_serving
    from benchmarks.workload import scaled

    rounds = args.rounds or profile.parallel_rounds
    # The KV cache is sized to the requests unless --kv-cache-memory is given: every rank
    # of every layout would otherwise hold the default 2 GiB.
    kv = None if args.kv_cache_memory == KV_DEFAULT else args.kv_cache_memory
    found = {}
    if not args.no_offline:
        requests = workload.requests[: profile.parallel_num_requests]
        requests = scaled(requests, profile.parallel_output_scale)
        layouts = listed(args.layouts, Layout.parse) or tuple(map(Layout.parse, DEFAULT_LAYOUTS))
        offline = ParallelOptions(folder, layouts=layouts, rounds=rounds, kv_cache_memory=kv)
        found["offline"] = load_average(run_layouts, requests, offline)
    if not args.no_async_serve:
        serve_requests = scaled(
            workload.requests[: profile.serve_num_requests], profile.serve_output_scale
        )
        serving = AsyncServingOptions(
            model=folder,
            rates=profile.serve_rates if args.rates else (),  # saturation only, unless asked
            deployments=(False,) if args.no_split else (False, True),
            rounds=rounds,
            kv_cache_memory=kv,
        )
        found["async_serving"] = load_average(run_async_serving, serve_requests, serving)
    return found


@dataclass(frozen=True)
class Section:
    name: str  # `pagestream bench NAME`
    key: str  # where results.json keeps its results
    run: Callable[..., dict]  # (args, folder, profile, workload, results) -> its results
    report: SectionReport  # renders its results (its part's, with `part`)
    # Self-contained: made of parts that each keep their own meta (command, date, machine);
    # a run replaces the parts it ran, and other sections' runs keep them all.
    self_contained: bool = False
    part: str | None = None  # a self-contained section of one part: its name
    own_workload: bool = False  # describes its own workload (not the profile's requests)


SECTIONS = (
    Section("throughput", "throughput", run_throughput, reports.THROUGHPUT),
    Section("serve", "serving", run_serving, reports.SERVING),
    Section("memory", "memory", run_memory, reports.MEMORY),
    Section("parallel", "parallel", run_parallel, reports.PARALLEL, self_contained=True),
    Section("routing", "routing", run_routing, reports.ROUTING, True, "dp2", own_workload=True),
    Section("structured", "structured", run_structured, reports.STRUCTURED, True, "offline", True),
    Section("precision", "precision", run_precision, reports.PRECISION, True, "offline"),
    Section("latency", "latency", run_latency, reports.LATENCY, True, "batch"),
    Section("serve_peer", "serve_peer", run_serve_peer, reports.SERVE_PEER, True, "llamacpp"),
    Section("quantized", "quantized", run_quantized, reports.QUANTIZED, True, "offline"),
    Section(
        "speculative", "speculative", run_speculative, reports.SPECULATIVE, True, "offline", True
    ),
    Section("lora", "lora", run_lora, reports.LORA, True, "offline", own_workload=True),
    Section("embed", "embed", run_embed, reports.EMBED, True, "offline", own_workload=True),
    Section("embed_encoder", "embed", run_embed_encoder, reports.ENCODER, True, "encoder", True),
)
BY_NAME = {s.name: s for s in SECTIONS}
