"""The report writer: results.json -> docs/benchmarks.md and its plots (benchmarks/plots.py),
written whole every time, every section that has results in SECTIONS' order, each rendered
from its results alone by its SectionReport."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from benchmarks import plots
from benchmarks.results import part_of
from benchmarks.routing import hit_rate_bound
from benchmarks.section_report import table
from benchmarks.sections import SECTIONS
from benchmarks.workload import PROFILES

logger = logging.getLogger(__name__)

CPU_NOTES = Path(__file__).parent / "data" / "cpu_notes.md"  # the CPU path's profile, by hand
ALLOCATIONS = ("paged", "prealloc_max", "prealloc_oracle")
TP1 = ("tp=1 (worker process)", "tp=1 (in process)")  # the step baselines, first found


def _header(results: dict) -> list[str]:
    meta = results.get("meta", {})
    machine = meta.get("machine", {})
    out = [
        "# Benchmarks",
        "",
        f"Reproduce: `{meta.get('command', 'pagestream bench all --profile quick')}` "
        f"(profile `{meta.get('profile')}`, model `{meta.get('model')}`).",
        "",
        f"Measured {machine.get('date')} on {machine.get('cpu')} ({machine.get('cores')} cores, "
        f"torch {machine.get('torch')} with {machine.get('torch_threads')} threads, "
        f"transformers {machine.get('transformers')}, Python {machine.get('python')}).",
        "",
    ]
    if meta.get("workload"):
        w = meta["workload"]
        out += [
            f"Workload: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens "
            f"(median {w['prompt_median']}, max {w['prompt_max']}), {w['output_tokens']} output "
            f"tokens (median {w['output_median']}, max {w['output_max']}); lognormal lengths, "
            "seeded, text from benchmarks/data/corpus.txt; greedy with ignore_eos.",
            "",
        ]
    profile = PROFILES.get(meta.get("profile"))  # results before runs kept their notes
    if notes := meta.get("notes") or (profile.notes() if profile else ""):
        out += [notes, ""]
    if results.get("throughput"):
        out += ["## Headline", "", headline(results["throughput"]), ""]
    return out


def headline(tp: dict) -> str:
    """pagestream in each dtype against HF and llama.cpp, with its matmul ceiling's fraction."""
    runs = {r["name"]: r for r in tp["runs"]}
    fractions = {
        **tp.get("ceiling", {}).get("fraction", {}),
        **tp.get("ceiling_bfloat16", {}).get("fraction", {}),
    }
    ours = {_dtype_of(n): r for n, r in runs.items() if n.startswith("pagestream")}
    shown = [n for n in runs if n.startswith("pagestream")]
    shown += [ratio["baseline"] for ratio in tp["ratios"].values()]
    rows = []
    for name in shown:
        run, mine = runs[name], ours.get(_dtype_of(name))
        speed = run["output_tokens_per_s"]
        faster = name.startswith("pagestream") or mine is None
        ratio = "1.00x" if faster else f"{mine['output_tokens_per_s'] / speed:.2f}x faster"
        fraction = fractions.get(name)
        rows.append([name, speed, ratio, None if fraction is None else f"{fraction:.0%}"])
    header = ["engine (offline, same prompts and lengths)", "output tok/s"]
    return table([*header, "pagestream, same dtype", "of the matmul ceiling"], rows)


def _dtype_of(name: str) -> str:
    return "bfloat16" if "bfloat16" in name or "BF16" in name else "float32"


def derived(results: dict) -> dict:
    """The results with the figures computed from the recorded ones: the KV cache's waste,
    routing's hit rate with prefixes spread over both replicas, each parallel layout's step
    forward minus tp = 1's (in a worker process where it ran) on the same model."""
    results = copy.deepcopy(results)
    kv = (results.get("memory") or {}).get("kv_utilization", {})
    if kv.get("num_samples"):
        kv.setdefault("waste", {k: round(1 - kv[k], 4) for k in ALLOCATIONS})
    for part in (results.get("routing") or {}).values():
        w = part["workload"]
        shape = (w["conversations"], w["turns"], w["system_prompt_len"], w["question_len"])
        part["kv_cache"].setdefault("spread_hit_rate", hit_rate_bound(*shape, computed=2))
    runs = (results.get("parallel") or {}).get("offline", {}).get("runs", [])
    for run in runs:
        same = [r for r in runs if r["model"] == run["model"] and r["layout"] in TP1]
        if run["tp"] == run["pp"] == 1 or not same:
            continue
        base = min(same, key=lambda r: TP1.index(r["layout"]))
        for kind in ("decode", "prefill"):
            step, tp1 = run["steps"].get(kind, {}), base["steps"].get(kind, {})
            if step.get("num_steps") and tp1.get("num_steps"):
                step.setdefault("tp1_layout", base["layout"])
                step.setdefault("tp1_forward_ms", tp1["forward_ms"])
                minus = round(step["forward_ms"] - tp1["forward_ms"], 2)
                step.setdefault("forward_minus_tp1_ms", minus)
    return results


def render(results: dict) -> str:
    results = derived(results)
    out = _header(results)
    for section in SECTIONS:
        if found := part_of(results, section.key, section.part):
            out += section.report.render(found)
            out += [""] * (out[-1] != "")  # a blank line between sections
    machine = results.get("meta", {}).get("machine", {})
    if machine and not machine.get("cuda") and CPU_NOTES.exists():
        out += [CPU_NOTES.read_text(encoding="utf-8").strip(), ""]
    return "\n".join(out)


def write_report(results: dict, docs_dir: Path) -> Path:
    """docs_dir/benchmarks.md plus docs_dir/benchmarks/*.png; returns the markdown path."""
    figures = docs_dir / "benchmarks"
    figures.mkdir(parents=True, exist_ok=True)
    plots.write_plots(results, figures)
    path = docs_dir / "benchmarks.md"
    path.write_text(render(results) + "\n", encoding="utf-8")
    logger.info("wrote %s", path)
    return path
