"""`pagestream bench`: throughput / serve / memory / all against HF transformers, the
parallel runs (tensor / pipeline parallelism and async scheduling on this machine),
routing across data-parallel replicas (benchmarks/routing.py) and what structured outputs
cost (benchmarks/structured.py).

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

Results accumulate in <docs>/benchmarks/results.json and the report is rewritten to
<docs>/benchmarks.md (tables) with PNG plots in <docs>/benchmarks/ after every section.
`parallel`, `routing` and `structured` are not part of `all`: each of their parts (parallel:
offline, async_serving; routing: dp2; structured: offline) keeps its own command, date and
machine, and they leave the other sections (and their meta) as they are.
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

from benchmarks import sections
from benchmarks.sections import KV_DEFAULT
from services.common.config import DEFAULT_MODEL

logger = logging.getLogger("pagestream.bench")

SECTIONS = ("throughput", "serve", "memory")  # what `all` runs
# Sections made of parts that each keep their own meta (command, date, machine); a run
# replaces the parts it ran and keeps the rest, and other sections' runs keep them all.
SELF_CONTAINED = (
    "parallel",
    "routing",
    "structured",
    "precision",
    "latency",
    "serve_peer",
    "quantized",
)
LLAMACPP_SEQS = "32"  # measured: 32 and 16 within 3% on the quick workload, 32 ahead
REPO_ROOT = Path(__file__).resolve().parent.parent


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench", help="benchmarks against HF transformers; writes docs/benchmarks.md"
    )
    add = bench.add_argument
    add("what", choices=(*SECTIONS, *SELF_CONTAINED, "all"), help="which benchmark to run")
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
        help="latency: skip llama.cpp at batch 1 (run by default; needs the bench extra)",
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
        "--llama-server", default=None, help="serve --peer: the binary (default $LLAMA_SERVER)"
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
        help="parallel, routing, structured: override the profile's rounds",
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


def _import_benchmarks():
    return importlib.import_module("benchmarks.workload")


def _floats(text: str | None) -> tuple[float, ...] | None:
    return None if text is None else tuple(float(x) for x in text.split(",") if x)


def _profile(args: argparse.Namespace):
    workload = _import_benchmarks()
    profile = workload.PROFILES[args.profile]
    changes: dict = {}
    if args.num_requests is not None:
        changes["num_requests"] = args.num_requests
        changes["serve_num_requests"] = min(profile.serve_num_requests, args.num_requests)
        changes["parallel_num_requests"] = min(profile.parallel_num_requests, args.num_requests)
    if args.hf_batch_sizes is not None:
        changes["hf_batch_sizes"] = tuple(int(x) for x in args.hf_batch_sizes.split(","))
    if args.rates is not None:
        changes["serve_rates"] = _floats(args.rates)
    return dataclasses.replace(profile, **changes)


def run_bench(args: argparse.Namespace) -> int:
    workload_mod = _import_benchmarks()
    from benchmarks import (
        report,
        report_latency,
        report_precision,
        report_quantized,
        report_routing,
        report_serve_peer,
        report_structured,
    )
    from services.worker.models.gguf_weights import dequantized_folder

    profile = _profile(args)
    folder = str(dequantized_folder(args.model))  # float weights: the unquantized runs
    from transformers import AutoTokenizer

    workload = workload_mod.make_workload(AutoTokenizer.from_pretrained(folder), profile)
    docs = Path(args.docs_dir)
    results_path = docs / "benchmarks" / "results.json"
    results = report.load_results(results_path)
    meta = {
        "profile": profile.name,
        "model": args.model,
        "command": command_line(args),
        "machine": report.machine_info(),
        "workload": workload.summary(),
    }
    if args.what in SELF_CONTAINED:
        notes = _notes_of(results)
    else:
        old = results.get("meta", {})
        if (old.get("profile"), old.get("model")) != (meta["profile"], meta["model"]):
            # another profile or model: start a fresh report (self-contained sections stay)
            results = {k: results[k] for k in SELF_CONTAINED if k in results}
        results["meta"] = meta
        notes = _notes(profile)
    sections = SECTIONS if args.what == "all" else (args.what,)
    if args.what == "serve" and args.peer:
        sections = ("serve_peer",)
    for section in sections:
        logger.info("bench %s (profile %s)", section, profile.name)
        found = _RUNNERS[section](args, folder, profile, workload, results)
        if section in SELF_CONTAINED:
            part_meta = _part_meta(meta, section)
            parts = {part: {**value, "meta": part_meta} for part, value in found.items()}
            found = {**results.get(section, {}), **parts}
        results[_RESULT_KEYS[section]] = found
        report.save_results(results_path, results)
        path = report.write_report(results, docs, notes=notes)
        report_routing.add_to_report(results, docs)  # report.py renders everything else
        report_structured.add_to_report(results, docs)
        report_precision.add_to_report(results, docs)
        report_latency.add_to_report(results, docs)
        report_serve_peer.add_to_report(results, docs)
        report_quantized.add_to_report(results, docs)
    logger.info("report: %s", path)
    return 0


def command_line(args: argparse.Namespace) -> str:
    """The `pagestream bench` command that reproduces this run (defaults left out)."""
    parts = ["pagestream", "bench", args.what, "--profile", args.profile]
    for flag, value, default in (
        ("--model", args.model, DEFAULT_MODEL),
        ("--num-requests", args.num_requests, None),
        ("--kv-cache-memory", args.kv_cache_memory, KV_DEFAULT),
        ("--hf-batch-sizes", args.hf_batch_sizes, None),
        ("--rates", args.rates, None),
        ("--layouts", args.layouts, None),
        ("--rounds", args.rounds, None),
        ("--policies", args.policies, None),
        ("--concurrency", args.concurrency, None),
        ("--llamacpp-seqs", args.llamacpp_seqs, LLAMACPP_SEQS),
        ("--peer", args.peer, None),
        ("--concurrencies", args.concurrencies, "1,4,16,64"),
    ):
        if value != default:
            parts += [flag, str(value)]
    for flag, on in (
        ("--no-hf", args.no_hf),
        ("--no-hf-continuous", args.no_hf_continuous),
        ("--bf16", args.bf16),
        ("--llamacpp", args.llamacpp),
        ("--no-split", args.no_split),
        ("--no-async-serve", args.no_async_serve),
        ("--no-offline", args.no_offline),
        ("--no-llamacpp", args.no_llamacpp),
        ("--single-process", args.single_process),
        ("--worker-process", args.worker_process),
    ):
        if on:
            parts.append(flag)
    return " ".join(parts)


def _part_meta(meta: dict, section: str) -> dict:
    """A part's meta; routing and structured describe their own workloads (not the
    profile's requests)."""
    own = section in ("routing", "structured")
    return {k: v for k, v in meta.items() if not (own and k == "workload")}


_RUNNERS = {
    "throughput": sections.run_throughput,
    "serve": sections.run_serving,
    "memory": sections.run_memory,
    "parallel": sections.run_parallel,
    "routing": sections.run_routing,
    "structured": sections.run_structured,
    "precision": sections.run_precision,
    "latency": sections.run_latency,
    "serve_peer": sections.run_serve_peer,
    "quantized": sections.run_quantized,
}
_RESULT_KEYS = {
    "throughput": "throughput",
    "serve": "serving",
    "memory": "memory",
    "parallel": "parallel",
    "routing": "routing",
    "structured": "structured",
    "precision": "precision",
    "latency": "latency",
    "serve_peer": "serve_peer",
    "quantized": "quantized",
}


def _notes_of(results: dict) -> str:
    """The notes of the profile the report's other sections ran with."""
    workload = _import_benchmarks()
    name = results.get("meta", {}).get("profile")
    return _notes(workload.PROFILES[name]) if name in workload.PROFILES else ""


def _notes(profile) -> str:
    """What the profile's serving runs scale down (the offline runs use its full shapes)."""
    if profile.name == "smoke":
        return "Profile `smoke`: a handful of short requests to check every driver end to end."
    return (
        f"Profile `{profile.name}`: {profile.num_requests} requests, prompts lognormal around "
        f"{profile.prompt_median} tokens in {profile.prompt_range[0]}..{profile.prompt_range[1]}, "
        f"outputs around {profile.output_median} in "
        f"{profile.output_range[0]}..{profile.output_range[1]}. Its serving runs use the first "
        f"{profile.serve_num_requests} requests with outputs scaled by "
        f"{profile.serve_output_scale} at rates {', '.join(map(str, profile.serve_rates))} "
        "and inf, so that every run stays short on a CPU."
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks WHAT [options]` (what `pagestream bench` runs)."""
    parser = argparse.ArgumentParser(prog="pagestream")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    level = os.environ.get("PAGESTREAM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_bench(args)
