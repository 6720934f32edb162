"""The benchmark report: results (JSON) -> docs/benchmarks.md with tables and PNG plots.

Results accumulate in ``<out>/benchmarks/results.json`` section by section (``throughput``,
``serving``, ``memory``, ``parallel``: benchmarks/report_parallel.py), so `pagestream bench
throughput` and `pagestream bench serve` run separately still produce one report; every
section that has results is rendered.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
from pathlib import Path

from benchmarks import plots
from benchmarks.report_llamacpp import llamacpp_lines
from benchmarks.report_parallel import parallel_section

logger = logging.getLogger(__name__)

# The profile of the CPU path behind the numbers (written by hand, dated inside).
CPU_NOTES = Path(__file__).parent / "data" / "cpu_notes.md"


def machine_info() -> dict:
    import torch
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_results(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    return {}


def save_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("—" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def headline(results: dict) -> str:
    """The README's table: pagestream in float32 and bfloat16 against HF transformers and
    llama.cpp on the same workload, with each run's fraction of its dtype's matmul ceiling."""
    tp = results.get("throughput")
    if not tp:
        return ""
    runs = {r["name"]: r for r in tp["runs"]}
    fractions = {
        **tp.get("ceiling", {}).get("fraction", {}),
        **tp.get("ceiling_bfloat16", {}).get("fraction", {}),
    }
    ours = {_dtype_of(n): r for n, r in runs.items() if n.startswith("pagestream")}
    shown = [n for n in runs if n.startswith("pagestream")]
    for key in ("vs_hf_static_best", "vs_hf_continuous", "vs_llamacpp_f32", "vs_llamacpp_bf16"):
        if key in tp["ratios"]:
            shown.append(tp["ratios"][key]["baseline"])
    rows = []
    for name in shown:
        run, mine = runs[name], ours.get(_dtype_of(name))
        speed = run["output_tokens_per_s"]
        ratio = (
            "1.00x"
            if name.startswith("pagestream") or mine is None
            else (f"{mine['output_tokens_per_s'] / speed:.2f}x faster")
        )
        fraction = fractions.get(name)
        rows.append([name, speed, ratio, None if fraction is None else f"{fraction:.0%}"])
    return _table(
        [
            "engine (offline, same prompts and lengths)",
            "output tok/s",
            "pagestream, same dtype",
            "of the matmul ceiling",
        ],
        rows,
    )


def _dtype_of(name: str) -> str:
    return "bfloat16" if "bfloat16" in name or "BF16" in name else "float32"


def _throughput_section(tp: dict, meta: dict) -> list[str]:
    rows = [
        [
            r["name"],
            r["requests_per_s"],
            r["output_tokens_per_s"],
            r["total_tokens_per_s"],
            r["elapsed_s"],
            r["generated_tokens"],
        ]
        for r in tp["runs"]
    ]
    out = [
        "## Offline throughput",
        "",
        _table(
            ["engine", "requests/s", "output tok/s", "total tok/s", "seconds", "tokens generated"],
            rows,
        ),
        "",
    ]
    for key, ratio in tp["ratios"].items():
        out.append(
            f"- {ratio.get('ours', 'pagestream')} / {ratio['baseline']}: "
            f"{ratio['requests_per_s']}x requests/s, "
            f"{ratio['output_tokens_per_s']}x output tok/s, {ratio['total_tokens_per_s']}x "
            f"total tok/s ({key})"
        )
    out += ["", *llamacpp_lines(tp)]
    for key in ("ceiling", "ceiling_bfloat16"):
        if key in tp:
            out += _ceiling_lines(tp[key])
    out += [
        "![offline throughput](benchmarks/throughput.png)",
        "",
    ]
    return out


def _ceiling_lines(ceiling: dict) -> list[str]:
    return [
        f"Matmul ceiling at the model's shapes ({ceiling['num_tokens']} tokens, "
        f"{ceiling['dtype']}, {ceiling['threads']} threads, the faster of F.linear and a "
        f"prepacked oneDNN linear): **{ceiling['gflops']} GFLOP/s** (per shape: "
        + ", ".join(f"{s['shape']} {s['gflops']}" for s in ceiling["per_shape"])
        + f"). The workload needs {ceiling['workload_gflop']['total']} GFLOP "
        f"({ceiling['workload_gflop']['linear']} in linear layers, "
        f"{ceiling['workload_gflop']['attention']} in attention), so the FLOP-bound time is "
        f"{ceiling['flop_bound_s']} s. Fraction of that bound each {ceiling['dtype']} run "
        "reached:",
        "",
        _table(["engine", "fraction of FLOP-bound"], list(ceiling["fraction"].items())),
        "",
    ]


def _serving_section(sv: dict) -> list[str]:
    rows = []
    for r in sv["runs"]:
        rows.append(
            [
                r["deployment"],
                r["transport"],
                r["rate"],
                r["completed"],
                r["failures"],
                r["output_tokens_per_s"],
                r["ttft_ms"]["p50"],
                r["ttft_ms"]["p99"],
                r["tpot_ms"]["p50"],
                r["tpot_ms"]["p99"],
                r["itl_ms"]["p50"],
                r["itl_ms"]["p99"],
            ]
        )
    out = [
        "## Online serving",
        "",
        f"{sv['num_requests']} requests ({sv['prompt_tokens']} prompt tokens, "
        f"{sv['output_tokens']} output tokens, ignore_eos) per run, Poisson arrivals at each "
        "rate (requests/s; `inf` sends all at once: saturated throughput), prefix caching "
        "off (every run reuses the prompts). Times in ms.",
        "",
        _table(
            [
                "deployment",
                "transport",
                "rate",
                "done",
                "failed",
                "output tok/s",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "ITL p50",
                "ITL p99",
            ],
            rows,
        ),
        "",
    ]
    if sv.get("split_ratios"):
        out += [
            "Cost of `--split-services` (split / one process, same transport and rate; "
            "target: throughput within 10%):",
            "",
            _table(
                ["transport", "rate", "throughput", "TTFT p50", "TPOT p50"],
                [
                    [r["transport"], r["rate"], r["throughput"], r["ttft_p50"], r["tpot_p50"]]
                    for r in sv["split_ratios"]
                ],
            ),
            "",
        ]
    out += ["![serving latency](benchmarks/serving.png)", ""]
    return out


def _memory_section(mem: dict) -> list[str]:
    kv, prefix, share = mem["kv_utilization"], mem["prefix_caching"], mem["sharing"]
    out = ["## Memory", "", "### KV-cache utilisation", ""]
    if kv.get("num_samples"):
        out += [
            f"Sampled after each of {kv['num_samples']} steps of the offline run: the share of "
            "allocated KV slots holding real tokens, against a system that reserves each live "
            f"request's maximum length up front (max_model_len {kv['max_model_len']}), or its "
            "exact final length (an oracle).",
            "",
            _table(
                ["allocation", "mean utilisation", "waste"],
                [
                    [
                        f"paged (blocks of {kv['block_size']})",
                        kv["paged"],
                        round(1 - kv["paged"], 4),
                    ],
                    [
                        "preallocate max_model_len",
                        kv["prealloc_max"],
                        round(1 - kv["prealloc_max"], 4),
                    ],
                    [
                        "preallocate exact length (oracle)",
                        kv["prealloc_oracle"],
                        round(1 - kv["prealloc_oracle"], 4),
                    ],
                ],
            ),
            "",
            "![KV utilisation](benchmarks/kv_utilization.png)",
            "",
        ]
    out += [
        "### Prefix caching",
        "",
        f"{prefix['num_requests']} requests sharing a {prefix['system_prompt_len']}-token system "
        f"prompt, each with its own {prefix['question_len']}-token question and "
        f"{prefix['output_len']} output tokens, admitted at once.",
        "",
        _table(
            ["prefix cache", "total tok/s", "TTFT mean ms", "TTFT p50 ms", "cached tokens"],
            [
                [
                    name,
                    prefix[name]["total_tokens_per_s"],
                    prefix[name]["ttft_mean_ms"],
                    prefix[name]["ttft_p50_ms"],
                    prefix[name]["cached_tokens"],
                ]
                for name in ("off", "on")
            ],
        ),
        "",
        f"Throughput {prefix['speedup']}x with caching; mean TTFT x{prefix['ttft_ratio']}.",
        "",
        "### Memory sharing",
        "",
        f"{share['num_prompts']} prompts ({share['prompt_tokens']} tokens), width "
        f"{share['width']}, {share['output_len']} output tokens per sequence; prefix caching off.",
        "",
        _table(
            ["run", "peak KV blocks", "saving vs independent"],
            [
                [
                    "independent requests (each prompt x width)",
                    share["independent"]["peak_blocks"],
                    "—",
                ],
                [
                    f"parallel sampling n={share['width']}",
                    share["parallel_sampling"]["peak_blocks"],
                    share["parallel_sampling"]["saving_vs_independent"],
                ],
                [
                    f"beam search width {share['width']}",
                    share["beam_search"]["peak_blocks"],
                    share["beam_search"]["saving_vs_independent"],
                ],
            ],
        ),
        "",
        "![memory](benchmarks/memory.png)",
        "",
    ]
    return out


def render(results: dict, notes: str = "") -> str:
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
    if notes:
        out += [notes.strip(), ""]
    table = headline(results)
    if table:
        out += ["## Headline", "", table, ""]
    if results.get("throughput"):
        out += _throughput_section(results["throughput"], meta)
    if results.get("serving"):
        out += _serving_section(results["serving"])
    if results.get("memory"):
        out += _memory_section(results["memory"])
    if results.get("parallel"):
        out += parallel_section(results["parallel"])
    if machine and not machine.get("cuda") and CPU_NOTES.exists():
        out += [CPU_NOTES.read_text(encoding="utf-8").strip(), ""]
    return "\n".join(out)


def write_report(results: dict, docs_dir: Path, notes: str = "") -> Path:
    """docs_dir/benchmarks.md plus docs_dir/benchmarks/*.png; returns the markdown path."""
    figures = docs_dir / "benchmarks"
    figures.mkdir(parents=True, exist_ok=True)
    plots.write_plots(results, figures)
    path = docs_dir / "benchmarks.md"
    path.write_text(render(results, notes) + "\n", encoding="utf-8")
    logger.info("wrote %s", path)
    return path
