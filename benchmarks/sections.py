"""The sections of `pagestream bench` (SECTIONS, in the report's order): each one's runner,
(args, folder, profile, workload, results) -> its results, where results.json keeps them, and
its report (benchmarks/reports.py). cli.py runs them; report.py renders them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import reports
from benchmarks.results import load_average
from benchmarks.section_report import SectionReport
from benchmarks.workload import scaled

KV_DEFAULT = "2GiB"  # --kv-cache-memory's default: the sections that size their own cache


def listed(text: str | None, kind=str) -> tuple:
    """The comma-separated values of an option ("1,4,16" -> (1, 4, 16)); () for none."""
    return tuple(kind(item.strip()) for item in (text or "").split(",") if item.strip())


def given(**values) -> dict:
    """The options the command line gave (the others keep their dataclass's default)."""
    return {name: value for name, value in values.items() if value}


def _own_kv(args) -> str | None:
    """--kv-cache-memory where given; None (the section sizes its cache) at the default."""
    return None if args.kv_cache_memory == KV_DEFAULT else args.kv_cache_memory


def _sized(profiles: dict, profile, args, count: str = "num_requests"):
    """The section's own profile of the run's profile name, --num-requests and --rounds applied."""
    return dataclasses.replace(
        profiles[profile.name], **given(**{count: args.num_requests}, rounds=args.rounds)
    )


def _tokenized(run, folder: str, options) -> dict:
    """run(tokenizer, options), with the load average around it."""
    from transformers import AutoTokenizer

    return load_average(run, AutoTokenizer.from_pretrained(folder), options)


def run_routing(args, folder, profile, workload, results) -> dict:
    from benchmarks.routing import ROUTING_PROFILES, RoutingOptions, run_routing

    routing = ROUTING_PROFILES[profile.name]
    options = RoutingOptions(folder, routing, kv_cache_memory=_own_kv(args), rounds=args.rounds)
    return _tokenized(run_routing, folder, options)


def run_structured(args, folder, profile, workload, results) -> dict:
    from benchmarks.structured import STRUCTURED_PROFILES, StructuredOptions, run_structured

    structured = _sized(STRUCTURED_PROFILES, profile, args, "num_prompts")
    options = StructuredOptions(folder, structured, args.kv_cache_memory)
    return _tokenized(run_structured, folder, options)


def run_precision(args, folder, profile, workload, results) -> dict:
    from benchmarks.precision import PrecisionOptions, run_precision

    options = PrecisionOptions(folder, args.kv_cache_memory, **given(rounds=args.rounds))
    return run_precision(workload.requests, options)


def run_latency(args, folder, profile, workload, results) -> dict:
    from benchmarks.latency import LatencyOptions, run_latency

    llamacpp, rounds = not args.no_llamacpp, given(rounds=args.rounds)
    options = LatencyOptions(args.model, folder, args.kv_cache_memory, llamacpp=llamacpp, **rounds)
    return run_latency(options)


def run_quantized(args, folder, profile, workload, results) -> dict:
    from benchmarks.quantized import QuantizedOptions, run_quantized

    return run_quantized(workload.requests, QuantizedOptions(args.model, args.kv_cache_memory))


def run_speculative(args, folder, profile, workload, results) -> dict:
    from benchmarks.speculative import SPECULATIVE_PROFILES, SpeculativeOptions, run_speculative

    options = SpeculativeOptions(
        folder,
        args.model,
        _sized(SPECULATIVE_PROFILES, profile, args),
        profile,
        args.kv_cache_memory,
        **given(batches=listed(args.batches, int), ks=listed(args.ks, int), draft=args.draft),
    )
    return _tokenized(run_speculative, folder, options)


def run_lora(args, folder, profile, workload, results) -> dict:
    from benchmarks.lora import LORA_PROFILES, LoRAOptions, run_lora

    lora = _sized(LORA_PROFILES, profile, args)
    options = LoRAOptions(folder, lora, profile, args.kv_cache_memory, adapter_dir=args.lora_dir)
    return _tokenized(run_lora, folder, options)


def run_embed(args, folder, profile, workload, results) -> dict:
    from benchmarks.embeddings import EMBED_PROFILES, EmbedOptions, run_embed

    embed = _sized(EMBED_PROFILES, profile, args, "num_inputs")
    options = EmbedOptions(folder, args.model, embed, args.kv_cache_memory)
    return _tokenized(run_embed, folder, options)


def run_embed_encoder(args, folder, profile, workload, results) -> dict:
    from benchmarks.encoders import ENCODER_PROFILES, EncoderOptions, run_encoders

    shapes = listed(args.encoders) or ("minilm", "bge-base")
    encoder = _sized(ENCODER_PROFILES, profile, args, "num_inputs")
    options = EncoderOptions(shapes, encoder, not args.no_llamacpp, args.llama_server)
    return load_average(run_encoders, options)


def run_reply_parsing(args, folder, profile, workload, results) -> dict:
    from benchmarks.reply_parsing import (
        REPLY_PARSING_PROFILES,
        ReplyParsingOptions,
        run_reply_parsing,
    )

    reply = _sized(REPLY_PARSING_PROFILES, profile, args, "requests_per_client")
    return load_average(run_reply_parsing, ReplyParsingOptions(reply))


def run_serve_peer(args, folder, profile, workload, results) -> dict:
    from transformers import AutoConfig

    from benchmarks.serve_peer import ServePeerOptions, run_serve_peer

    layouts = ("engine-core-process",) + ("single-process",) * args.single_process
    options = ServePeerOptions(
        args.model,
        folder,
        same_file=Path(args.model).suffix.lower() == ".gguf" and Path(args.model).is_file(),
        concurrencies=listed(args.concurrencies, int),
        layouts=layouts + ("worker-process",) * args.worker_process,
        llama_server=args.llama_server,
        **given(rounds=args.rounds),
    )
    return run_serve_peer(options, AutoConfig.from_pretrained(folder).vocab_size)


def run_throughput(args, folder, profile, workload, results) -> dict:
    from benchmarks.throughput import ThroughputOptions, run_throughput

    options = ThroughputOptions(
        model=folder,
        hf_batch_sizes=() if args.no_hf else profile.hf_batch_sizes,
        hf_continuous=not args.no_hf,
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
    return LlamaCppOptions(args.model, ("F32", "BF16") if args.bf16 else ("F32",))


def _serve_requests(workload, profile) -> list:
    """The serving runs' requests: the profile's first, outputs scaled down."""
    requests = workload.requests[: profile.serve_num_requests]
    return scaled(requests, profile.serve_output_scale)


def run_serving(args, folder, profile, workload, results) -> dict:
    from benchmarks.serving import ServingOptions, run_serving

    # No prefix caching: the runs reuse the prompts. float32 as the HF baselines (auto is
    # bfloat16 on CPUs with native bf16).
    flags = ("--kv-cache-memory", args.kv_cache_memory, "--no-enable-prefix-caching")
    flags += ("--dtype", "float32")
    options = ServingOptions(
        folder, profile.serve_rates, split_services=not args.no_split, engine_flags=flags
    )
    return run_serving(_serve_requests(workload, profile), options)


def run_memory(args, folder, profile, workload, results) -> dict:
    from benchmarks.memory import MemoryOptions, run_memory

    options = MemoryOptions(folder, profile, args.kv_cache_memory)
    kv = (results.get("throughput") or {}).get("runs", [{}])[0].get("kv_utilization")
    return run_memory(workload.requests, options, kv_utilization=kv)


def run_parallel(args, folder, profile, workload, results) -> dict:
    """Offline layouts side by side, then async scheduling on / off behind the servers; the
    KV cache sized to the requests unless --kv-cache-memory is given."""
    from benchmarks.parallel import DEFAULT_LAYOUTS, Layout, ParallelOptions
    from benchmarks.parallel import run_parallel as run_layouts
    from benchmarks.serving import AsyncServingOptions, run_async_serving

    rounds, kv, found = args.rounds or profile.parallel_rounds, _own_kv(args), {}
    if not args.no_offline:
        requests = workload.requests[: profile.parallel_num_requests]
        requests = scaled(requests, profile.parallel_output_scale)
        layouts = listed(args.layouts or ",".join(DEFAULT_LAYOUTS), Layout.parse)
        offline = ParallelOptions(folder, layouts=layouts, rounds=rounds, kv_cache_memory=kv)
        found["offline"] = load_average(run_layouts, requests, offline)
    if not args.no_async_serve:
        serving = AsyncServingOptions(
            model=folder,
            rates=profile.serve_rates if args.rates else (),  # saturation only, unless asked
            deployments=(False,) if args.no_split else (False, True),
            rounds=rounds,
            kv_cache_memory=kv,
        )
        requests = _serve_requests(workload, profile)
        found["async_serving"] = load_average(run_async_serving, requests, serving)
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
    model: str | None = None  # the model it builds itself (its meta's; --model is not loaded)


SECTIONS = (
    Section("throughput", "throughput", run_throughput, reports.THROUGHPUT),
    Section("serve", "serving", run_serving, reports.SERVING),
    Section("memory", "memory", run_memory, reports.MEMORY),
    Section("parallel", "parallel", run_parallel, reports.PARALLEL, self_contained=True),
    Section("routing", "routing", run_routing, reports.ROUTING, True, "dp2", True),
    Section("structured", "structured", run_structured, reports.STRUCTURED, True, "offline", True),
    Section("precision", "precision", run_precision, reports.PRECISION, True, "offline"),
    Section("latency", "latency", run_latency, reports.LATENCY, True, "batch"),
    Section("serve_peer", "serve_peer", run_serve_peer, reports.SERVE_PEER, True, "llamacpp"),
    Section("quantized", "quantized", run_quantized, reports.QUANTIZED, True, "offline"),
    Section(
        "speculative", "speculative", run_speculative, reports.SPECULATIVE, True, "offline", True
    ),
    Section("lora", "lora", run_lora, reports.LORA, True, "offline", True),
    Section("embed", "embed", run_embed, reports.EMBED, True, "offline", True),
    Section("embed_encoder", "embed", run_embed_encoder, reports.ENCODER, True, "encoder", True),
    Section(
        "reply_parsing",
        "reply_parsing",
        run_reply_parsing,
        reports.REPLY_PARSING,
        True,
        "qwen3_hermes",
        True,
        model="a scripted Qwen3-style tiny llama (benchmarks/scripted_chat.py)",
    ),
)
BY_NAME = {s.name: s for s in SECTIONS}
