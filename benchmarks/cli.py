"""`pagestream bench`: every section of the report (benchmarks/sections.py) and the tools that
write none (TOOLS). `pagestream bench` runs this module in a child process (`python -m
benchmarks`), so the pagestream package never imports the benchmarks.

    pagestream bench all --profile quick   # what `make bench` runs: throughput, serve, memory
    pagestream bench serve --peer llamacpp  # beside llama-server at concurrency 1/4/16/64

Results accumulate in <docs>/benchmarks/results.json; each section rewrites <docs>/benchmarks.md.
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
# `pagestream bench NAME ARGS` runs benchmarks/NAME.py's main(ARGS): measurements of one part
TOOLS = {
    "native_step_profile": "where a native CPU decode step's time goes",
    "collectives": "what one gloo collective costs between local processes",
    "kernels": "the Triton paged-attention kernels (CUDA)",
    "soak": "mixed traffic against the split deployment for a fixed time",
}
# (flag, kind, help): kind False is a switch, a type a value of it (default None), a tuple the
# choices (the first the default), anything else the default.
OPTIONS = (
    ("--model", DEFAULT_MODEL, "model name or folder"),
    ("--profile", ("quick", "full", "smoke"), "the workload's size"),
    ("--num-requests", int, "override the profile's request count"),
    ("--docs-dir", "docs", "where benchmarks.md and its plots go"),
    ("--kv-cache-memory", KV_DEFAULT, "KV cache (parallel, routing: sized unless given)"),
    ("--no-hf", False, "skip the HF transformers baselines"),
    ("--bf16", False, "also run pagestream in bfloat16"),
    ("--llamacpp", False, "throughput: also llama.cpp (F32, BF16 with --bf16)"),
    ("--rates", str, "serving request rates (req/s), e.g. 1,4"),
    ("--no-split", False, "skip the --split-services comparison"),
    ("--no-llamacpp", False, "latency, embed --encoders: skip llama.cpp / llama-server"),
    ("--encoders", str, "embed: random encoders of these shapes (minilm, bge-base, tiny)"),
    ("--peer", (None, "llamacpp"), "serve: closed-loop clients against the peer's own server"),
    ("--concurrencies", "1,4,16,64", "serve --peer: the levels"),
    ("--llama-server", str, "serve --peer, embed --encoders: the binary ($LLAMA_SERVER)"),
    ("--single-process", False, "serve --peer: also `pagestream serve --single-process`"),
    ("--worker-process", False, "serve --peer: also the worker in a process of its own"),
    ("--layouts", str, "parallel: layouts, e.g. tp1,tp1-async,tp1-mp,tp2,tp3,pp2,tp2xpp2"),
    ("--rounds", int, "override the profile's rounds (the self-contained sections)"),
    ("--no-async-serve", False, "parallel: skip the serving runs with async scheduling on / off"),
    ("--no-offline", False, "parallel: skip the offline layouts (keep their last results)"),
    ("--batches", str, "speculative: batch sizes (default 1,4,16,32)"),
    ("--ks", str, "speculative: ngram num_speculative_tokens (default 2,4,6)"),
    ("--draft", str, "speculative: Q4_0 (default), Q8_0, gguf, a model path or none"),
    ("--lora-dir", str, "lora: where its adapters are made ($PAGESTREAM_CACHE/bench-lora)"),
)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks against HF transformers; writes docs/benchmarks.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="measurements without a report section (pagestream bench NAME --help):\n"
        + "\n".join(f"  {name:20} {what}" for name, what in TOOLS.items()),
    )
    bench.add_argument("what", choices=(*BY_NAME, "all"), help="which benchmark to run")
    for flag, kind, text in OPTIONS:
        if kind is False:
            bench.add_argument(flag, action="store_true", help=text)
        elif isinstance(kind, tuple):
            bench.add_argument(flag, default=kind[0], choices=[c for c in kind if c], help=text)
        else:
            kwargs = {"type": kind} if isinstance(kind, type) else {"default": kind}
            bench.add_argument(flag, help=text, **kwargs)
    return bench


def _profile(args: argparse.Namespace):
    profile, changes = PROFILES[args.profile], {}
    if args.num_requests is not None:
        changes["num_requests"] = args.num_requests
        changes["serve_num_requests"] = min(profile.serve_num_requests, args.num_requests)
        changes["parallel_num_requests"] = min(profile.parallel_num_requests, args.num_requests)
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

    profile, chosen = _profile(args), _chosen(args)
    own_model = all(s.model for s in chosen)  # then --model is neither loaded nor named
    folder = workload = None
    if not own_model:
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
        "workload": workload.summary() if workload else None,
    }
    if own_model:
        meta["model"] = chosen[0].model
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
