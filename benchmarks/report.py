"""The report writer: the results (results.json, benchmarks/results.py) -> docs/benchmarks.md
and its PNG plots (benchmarks/plots.py).

The file is written whole every time from every section that has results, in the order of
benchmarks/sections.py's SECTIONS, each rendered by its SectionReport from its results alone
(benchmarks/section_report.py; old records through benchmarks/migration.py): `pagestream
bench throughput` and `pagestream bench routing` run separately still produce one report,
and a section run again replaces its old text.
"""

from __future__ import annotations

import logging
from pathlib import Path

from benchmarks import plots
from benchmarks.markdown import table
from benchmarks.migration import migrate
from benchmarks.results import part_of
from benchmarks.sections import SECTIONS
from benchmarks.workload import PROFILES

logger = logging.getLogger(__name__)

# The profile of the CPU path behind the numbers (written by hand, dated inside).
CPU_NOTES = Path(__file__).parent / "data" / "cpu_notes.md"


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
    if notes := _notes(results):
        out += [notes, ""]
    if results.get("throughput"):
        out += ["## Headline", "", headline(results["throughput"]), ""]
    return out


def _notes(results: dict) -> str:
    """The main sections' profile, as their run described it (results written before runs
    kept their notes: the stock profile of that name)."""
    meta = results.get("meta", {})
    profile = PROFILES.get(meta.get("profile"))
    return meta.get("notes") or (profile.notes() if profile else "")


def headline(tp: dict) -> str:
    """The README's table: pagestream in float32 and bfloat16 against HF transformers and
    llama.cpp on the same workload, with each run's fraction of its dtype's matmul ceiling."""
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


def render(results: dict) -> str:
    results = migrate(results)
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
