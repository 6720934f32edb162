"""The plot of the "Structured outputs" section (benchmarks/report_structured.py):
throughput per run, compile times cold and cached, and the mask fill per row."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DPI = 110
LABELS = {
    "unconstrained": "unconstrained",
    "json_schema": "JSON schema",
    "matched_length": "no grammar, constrained lengths",
}


def write_plot(part: dict, path: Path) -> Path:
    fig, (tput, compile_ax, mask_ax) = plt.subplots(1, 3, figsize=(12, 3.8))
    _plot_throughput(tput, part)
    _plot_compile(compile_ax, part)
    _plot_masks(mask_ax, part)
    fig.suptitle("structured outputs (JSON schema) on one engine", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _plot_throughput(ax, part: dict) -> None:
    summary = part["summary"]["variants"]
    names = [LABELS[v].replace(", ", ",\n") for v in summary]
    bars = ax.bar(
        names,
        [s["output_tokens_per_s"] for s in summary.values()],
        color=["tab:gray", "tab:blue", "tab:green"],
    )
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylim(0, 1.15 * max(s["output_tokens_per_s"] for s in summary.values()))
    ax.set_title("output tokens / s (median)")
    ax.tick_params(axis="x", labelsize=7)


def _plot_compile(ax, part: dict) -> None:
    grammars = part["compile"]["grammars"]
    for kind, marker in (("json", "o"), ("regex", "s"), ("lark", "^")):
        chosen = [g for g in grammars if g["kind"] == kind]
        if not chosen:
            continue
        sizes = [g["grammar_chars"] for g in chosen]
        ax.scatter(sizes, [g["cold_ms"] for g in chosen], marker=marker, label=f"{kind} cold")
        cached = [min(g["cached_ms"]) for g in chosen if g["cached_ms"]]
        if cached:
            ax.scatter(sizes, cached, marker=marker, facecolors="none", edgecolors="gray")
    ax.scatter([], [], marker="o", facecolors="none", edgecolors="gray", label="cached")
    ax.set_yscale("log")
    ax.set_xlabel("grammar size (chars)")
    ax.set_title("compile time (ms)")
    ax.legend(fontsize=7)


def _plot_masks(ax, part: dict) -> None:
    m = part["mask_fill"]
    fills = m["fills"]
    labels = [k.replace("_", "\n") for k in fills]
    x = range(len(labels))
    for offset, key in ((-0.2, "p50"), (0.2, "p99")):
        values = [f["us_per_row"][key] for f in fills.values()]
        bars = ax.bar([i + offset for i in x], values, 0.4, label=key)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(list(x), labels)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"mask fill, µs per row (parallel: {m['parallel_threads']} threads)")
    ax.legend(fontsize=7)
