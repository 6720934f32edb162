"""`pagestream bench`: every section of the report (benchmarks/sections.py: throughput /
serve / memory / all against HF transformers and llama.cpp, the parallel runs, routing,
structured outputs, precision, latency, serve --peer, quantized, speculative, lora, embed),
and the measurement tools that write no section (TOOLS: `pagestream bench kernels --flex`
runs benchmarks/kernels.py).

    pagestream bench all --profile quick     # what `make bench` runs (~30 min on 2 cores)
    pagestream bench throughput --profile full --bf16
    pagestream bench throughput --llamacpp --bf16  # + llama.cpp F32 / BF16 (the bench extra)
    pagestream bench parallel --profile quick   # tp = 1/2/3, pp = 2, async on/off (~15 min)
    pagestream bench routing --profile quick    # serve -dp 2 under each router policy
    pagestream bench structured --profile quick # JSON schema vs none, compile times (~3 min)
    pagestream bench precision --profile quick  # bfloat16 vs float32: speed and agreement
    pagestream bench latency                    # ms per output token at batch 1/4/16 vs
                                                # the weight-streaming limit and llama.cpp
    pagestream bench serve --peer llamacpp      # served side by side with llama-server at
                                                # concurrency 1/4/16/64 (~15 min)
    pagestream bench speculative                # ngram / draft models vs none at batch
                                                # 1/4/16, copy-heavy and default prompts
                                                # (~10 min; --profile full: ~1 hour)
    pagestream bench lora                       # 0 / 1 / 4 / 16 random adapters of rank 8
                                                # and 64 vs the base model, batched and one
                                                # chat (~10 min; --profile full: ~45 min)
    pagestream bench embed                      # the pooling runner's embeddings vs HF
                                                # AutoModel, inputs/s (~6 min)
    pagestream bench embed --encoders minilm,bge-base  # random BERT-shaped encoders vs
                                                # sentence-transformers and llama-server

Results accumulate in <docs>/benchmarks/results.json and the report is rewritten whole to
<docs>/benchmarks.md (tables) with PNG plots in <docs>/benchmarks/ after every section
(benchmarks/report.py). Only throughput, serve and memory make up `all`; the others are
self-contained: each of their parts (parallel: offline, async_serving; routing: dp2; ...)
keeps its own command, date and machine, and they leave the other sections (and their
meta) as they are.
This module is the `benchmarks` package's command line (`python -m benchmarks ...`);
`pagestream bench ...` runs it in a child process, so the pagestream package never imports
the benchmarks (they import pagestream).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
from pathlib import Path

from benchmarks.results import load_results, machine_info, save_results
from benchmarks.sections import BY_NAME, KV_DEFAULT, SECTIONS, Section, listed
from benchmarks.workload import PROFILES, make_workload
from services.common.config import DEFAULT_MODEL

logger = logging.getLogger("pagestream.bench")

ALL = ("throughput", "serve", "memory")  # what `all` runs
LLAMACPP_SEQS = "32"  # measured: 32 and 16 within 3% on the quick workload, 32 ahead
# Measurements of one part that write no report section: `pagestream bench NAME ARGS` runs
# benchmarks/NAME.py's main(ARGS) (`pagestream bench NAME --help` lists its options).
TOOLS = {
    "attention_cpu": "the torch paged attention on the CPU, per varlen mix",
    "linear_cpu": "which matmul form is fastest at which row count (CPU)",
    "native_step_profile": "where a native CPU decode step's time goes",
    "scheduler_sweep": "the CPU scheduler defaults, swept",
    "collectives": "what one gloo collective costs between local processes",
    "kernels": "the Triton paged-attention kernels (CUDA)",
    "soak": "mixed traffic against the split deployment for a fixed time",
}


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks against HF transformers; writes docs/benchmarks.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="measurements without a report section (pagestream bench NAME --help):\n"
        + "\n".join(f"  {name:20} {what}" for name, what in TOOLS.items()),
    )
    add = bench.add_argument
    add("what", choices=(*BY_NAME, "all"), help="which benchmark to run")
    add("--model", default=DEFAULT_MODEL, help="model name or folder")
    add("--profile", default="quick", choices=("quick", "full", "smoke"))
    add("--num-requests", type=int, default=None, help="override the profile's request count")
    add("--docs-dir", default="docs", help="where benchmarks.md and its plots go")
    add(
        "--kv-cache-memory",
        default=KV_DEFAULT,
        help="pagestream's KV cache (CPU); parallel: sized to the requests unless given; "
        "routing: per replica, sized by the profile unless given",
    )
    add("--hf-batch-sizes", default=None, help="HF static batch sizes, e.g. 8,16,32")
    add("--no-hf", action="store_true", help="skip the HF transformers baselines")
    add("--no-hf-continuous", action="store_true", help="skip HF continuous batching")
    add("--bf16", action="store_true", help="also run pagestream in bfloat16")
    add(
        "--llamacpp",
        action="store_true",
        help="throughput: also run llama.cpp (F32, and BF16 with --bf16) on the same weights; "
        "needs `pip install 'pagestream[bench]'`",
    )
    add(
        "--llamacpp-seqs",
        default=LLAMACPP_SEQS,
        help="llama.cpp's parallel sequences (n_seq_max), e.g. 16,32: each is run, the "
        "ratios use the fastest",
    )
    add("--rates", default=None, help="serving request rates (req/s), e.g. 1,4")
    add("--no-split", action="store_true", help="skip the --split-services comparison")
    add(
        "--no-llamacpp",
        action="store_true",
        help="latency: skip llama.cpp at batch 1 (run by default; needs the bench extra); "
        "embed --encoders: skip llama-server",
    )
    add(
        "--encoders",
        default=None,
        help="embed: random encoders of these shapes (minilm, bge-base; tiny) instead of "
        "--model, against sentence-transformers and llama-server (--llama-server)",
    )
    peer = bench.add_argument_group("serve --peer")
    peer.add_argument(
        "--peer",
        choices=("llamacpp",),
        default=None,
        help="serve: instead of the rate sweep, closed-loop clients at each --concurrencies "
        "against pagestream serve and the peer's own server (llama-server) on the same weights",
    )
    peer.add_argument("--concurrencies", default="1,4,16,64", help="serve --peer: levels")
    peer.add_argument(
        "--llama-server",
        default=None,
        help="serve --peer, embed --encoders: the binary (default $LLAMA_SERVER)",
    )
    peer.add_argument(
        "--single-process",
        action="store_true",
        help="serve --peer: also run `pagestream serve --single-process`",
    )
    peer.add_argument(
        "--worker-process",
        action="store_true",
        help="serve --peer: also run the worker in a process of its own below the engine core "
        "(--distributed-executor-backend mp)",
    )
    parallel = bench.add_argument_group("parallel")
    parallel.add_argument(
        "--layouts",
        default=None,
        help="parallel: layouts to run, e.g. tp1,tp1-async,tp1-mp,tp2,tp3,pp2,tp2xpp2 "
        "(-mp: tp=1 in a worker process; -async: --async-scheduling)",
    )
    parallel.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="parallel, routing, structured, speculative, lora, embed: override the profile's "
        "rounds",
    )
    parallel.add_argument(
        "--no-async-serve",
        action="store_true",
        help="parallel: skip the serving runs with async scheduling on vs off",
    )
    parallel.add_argument(
        "--no-offline",
        action="store_true",
        help="parallel: skip the offline layouts (keep their last results)",
    )
    speculative = bench.add_argument_group("speculative")
    speculative.add_argument(
        "--batches", default=None, help="speculative: batch sizes (default 1,4,16,32)"
    )
    speculative.add_argument(
        "--ks", default=None, help="speculative: ngram num_speculative_tokens (default 2,4,6)"
    )
    speculative.add_argument(
        "--draft",
        default=None,
        help="speculative: the cheaper draft of the target: Q4_0 (default) or Q8_0, made by "
        "$LLAMA_QUANTIZE from the model's GGUF file (that file itself when it cannot be made), "
        "gguf (the model's own GGUF file), a model path, or none",
    )
    speculative.add_argument(
        "--draft-k", type=int, default=None, help="speculative: the drafts' k (default 3)"
    )
    speculative.add_argument(
        "--prompt-lookup-min", type=int, default=None, help="speculative: ngram's (default 2)"
    )
    speculative.add_argument(
        "--prompt-lookup-max", type=int, default=None, help="speculative: ngram's (default 5)"
    )
    lora = bench.add_argument_group("lora")
    lora.add_argument("--lora-ranks", default=None, help="lora: adapter ranks (default 8,64)")
    lora.add_argument(
        "--lora-adapters",
        default=None,
        help="lora: how many adapters the requests are spread over (default 1,4,16)",
    )
    lora.add_argument(
        "--lora-dir",
        default=None,
        help="lora: where its random adapters are made once (default $PAGESTREAM_CACHE/bench-lora)",
    )
    routing = bench.add_argument_group("routing")
    routing.add_argument(
        "--policies",
        default=None,
        help="routing: router policies to compare, e.g. cache_aware,round_robin "
        "(default: cache_aware,round_robin,least_loaded)",
    )
    routing.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="routing: requests in flight (default: the profile's)",
    )
    return bench


def _profile(args: argparse.Namespace):
    profile = PROFILES[args.profile]
    changes: dict = {}
    if args.num_requests is not None:
        changes["num_requests"] = args.num_requests
        changes["serve_num_requests"] = min(profile.serve_num_requests, args.num_requests)
        changes["parallel_num_requests"] = min(profile.parallel_num_requests, args.num_requests)
    if args.hf_batch_sizes is not None:
        changes["hf_batch_sizes"] = listed(args.hf_batch_sizes, int)
    if args.rates is not None:
        changes["serve_rates"] = listed(args.rates, float)
    return dataclasses.replace(profile, **changes)


def _chosen(args: argparse.Namespace) -> tuple[Section, ...]:
    if args.what == "all":
        return tuple(BY_NAME[name] for name in ALL)
    if args.what == "serve" and args.peer:
        return (BY_NAME["serve_peer"],)
    if args.what == "embed" and args.encoders:
        return (BY_NAME["embed_encoder"],)
    return (BY_NAME[args.what],)


def run_bench(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from benchmarks import report
    from services.worker.models.gguf_weights import dequantized_folder

    profile = _profile(args)
    folder = str(dequantized_folder(args.model))  # float weights: the unquantized runs
    workload = make_workload(AutoTokenizer.from_pretrained(folder), profile)
    docs = Path(args.docs_dir)
    results_path = docs / "benchmarks" / "results.json"
    results = load_results(results_path)
    encoders = args.what == "embed" and args.encoders
    meta = {
        "profile": profile.name,
        "model": f"random encoders {args.encoders}" if encoders else args.model,
        "command": command_line(args),
        "machine": machine_info(),
        "workload": workload.summary(),
    }
    chosen = _chosen(args)
    if not all(s.self_contained for s in chosen):  # else the other sections' meta stays
        results = {**_kept(results, meta), "meta": {**meta, "notes": profile.notes()}}
    for section in chosen:
        logger.info("bench %s (profile %s)", section.name, profile.name)
        found = section.run(args, folder, profile, workload, results)
        results[section.key] = _merged(section, found, results.get(section.key, {}), meta)
        save_results(results_path, results)
        path = report.write_report(results, docs)
    logger.info("report: %s", path)
    return 0


def _kept(results: dict, meta: dict) -> dict:
    """What a run of the main sections keeps: everything under the same profile and model;
    under another, only the self-contained sections (a fresh report for the rest)."""
    old = results.get("meta", {})
    if (old.get("profile"), old.get("model")) == (meta["profile"], meta["model"]):
        return results
    return {s.key: results[s.key] for s in SECTIONS if s.self_contained and s.key in results}


def _merged(section: Section, found: dict, old: dict, meta: dict) -> dict:
    """The section's new results; a self-contained one's parts each with the run's meta,
    replacing only the parts that ran."""
    if section.part:
        found = {section.part: found}
    if not section.self_contained:
        return found
    part_meta = {k: v for k, v in meta.items() if not (section.own_workload and k == "workload")}
    return {**old, **{part: {**value, "meta": part_meta} for part, value in found.items()}}


def command_line(args: argparse.Namespace) -> str:
    """The `pagestream bench` command that reproduces this run (defaults left out)."""
    parts = ["pagestream", "bench", args.what, "--profile", args.profile]
    for action in _bench_parser()._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "profile", "docs_dir"):
            continue
        if value != action.default:
            flag = action.option_strings[0]
            parts += [flag] if action.nargs == 0 else [flag, str(value)]
    return " ".join(parts)


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagestream")
    return add_bench_parser(parser.add_subparsers(dest="command", required=True))


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks WHAT [options]` (what `pagestream bench` runs)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        return importlib.import_module(f"benchmarks.{argv[0]}").main(argv[1:]) or 0
    args = _bench_parser().parse_args(argv)
    level = os.environ.get("PAGESTREAM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_bench(args)
