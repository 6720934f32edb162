"""The report's PNG plots (matplotlib, headless): each section's SectionReport names its plots,
drawn from its results by the function of that name into <docs>/benchmarks/<name>.png."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.results import part_of

DPI = 110
LABELS = {  # the structured runs
    "unconstrained": "unconstrained",
    "json_schema": "JSON schema",
    "matched_length": "no grammar, constrained lengths",
}


def write_plots(results: dict, folder: Path) -> list[Path]:
    from benchmarks.sections import SECTIONS

    written = []
    for section in SECTIONS:
        if found := part_of(results, section.key, section.part):
            for name in section.report.plots:
                fig = globals()[name](found)
                fig.tight_layout()
                fig.savefig(folder / f"{name}.png", dpi=DPI)
                plt.close(fig)
                written.append(folder / f"{name}.png")
    return written


def _bars(ax, x, values, fmt="%.0f", size=None, **kwargs) -> None:
    """Bars labelled with their values (fmt; size: the labels' font size)."""
    bars = ax.bar(x, values, **kwargs)
    ax.bar_label(bars, fmt=fmt, **({"fontsize": size} if size else {}))


def _paired(ax, labels: list, series: dict, width: float) -> None:
    """A bar per series {name: values} side by side at each label."""
    x = range(len(labels))
    for offset, (name, values) in zip((-width / 2, width / 2), series.items(), strict=True):
        _bars(ax, [i + offset for i in x], values, "%.0f", 7, width=width, label=name)
    ax.set_xticks(list(x), labels)


def throughput(tp: dict):
    runs = tp["runs"]
    names = [r["name"].replace(" (", "\n(").replace(", static", "\nstatic") for r in runs]
    colors = ["tab:blue" if r["name"].startswith("pagestream") else "tab:gray" for r in runs]
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, range(len(runs)), [r["output_tokens_per_s"] for r in runs], color=colors)
    ax.set_xticks(range(len(runs)), names, fontsize=7)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Offline throughput, same prompts and output lengths")
    return fig


def serving(sv: dict):
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(9, 3.6))
    series: dict[tuple[str, str], list[dict]] = {}
    for run in sv["runs"]:
        if run["rate"] != "inf":
            series.setdefault((run["deployment"], run["transport"]), []).append(run)
    for (deployment, transport), runs in series.items():
        rates, label = [r["rate"] for r in runs], f"{transport}, {deployment}"
        style = "--" if deployment.startswith("split") else "-"
        ttft.plot(rates, [r["ttft_ms"]["p50"] for r in runs], style, marker="o", label=label)
        tpot.plot(rates, [r["tpot_ms"]["p50"] for r in runs], style, marker="o", label=label)
    for ax, title in ((ttft, "TTFT p50 (ms)"), (tpot, "TPOT p50 (ms)")):
        ax.set_xlabel("request rate (requests/s)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return fig


def kv_utilization(mem: dict):
    series = mem["kv_utilization"].get("series", [])
    fig, ax = plt.subplots(figsize=(8, 3.4))
    if series:
        for key, label in (
            ("used", "paged"),
            ("reserved_oracle", "preallocate exact length"),
            ("reserved_max", "preallocate max_model_len"),
        ):
            ax.plot(range(len(series)), [s["real"] / s[key] for s in series], label=label)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    ax.set_xlabel("sample (engine steps)")
    ax.set_ylabel("real tokens / allocated slots")
    ax.set_title("KV-cache utilisation over the offline run")
    return fig


def memory(mem: dict):
    prefix, share = mem["prefix_caching"], mem["sharing"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    ttfts = [prefix["off"]["ttft_mean_ms"], prefix["on"]["ttft_mean_ms"]]
    _bars(left, ["prefix cache off", "prefix cache on"], ttfts)
    left.set_ylabel("mean TTFT (ms)")
    left.set_title("Shared system prompt")
    names = ["independent", f"n={share['width']}", f"beam {share['width']}"]
    peaks = [share[k]["peak_blocks"] for k in ("independent", "parallel_sampling", "beam_search")]
    _bars(right, names, peaks, "%g", color=["tab:gray", "tab:blue", "tab:blue"])
    right.set_ylabel("peak KV blocks")
    right.set_title("Memory sharing")
    return fig


def routing(part: dict):
    summary = part["summary"]
    names = [s["policy"] for s in summary]
    fig, (hits, ttft, tput) = plt.subplots(1, 3, figsize=(11, 3.6))
    _bars(hits, names, [s["hit_rate"] for s in summary], "%.2f", color="tab:blue")
    hits.axhline(part["best_hit_rate"], color="gray", linestyle="--", label="best possible")
    hits.set_ylim(0, 1)
    hits.set_title("prefix-cache hit rate")
    hits.legend(fontsize=7, loc="lower right")
    ttfts = {p: [s[f"ttft_{p}_ms"] or 0 for s in summary] for p in ("p50", "p99")}
    _paired(ttft, names, ttfts, 0.38)
    ttft.set_title("TTFT (ms)")
    ttft.legend(fontsize=7)
    _bars(tput, names, [s["output_tokens_per_s"] for s in summary], "%.1f", color="tab:green")
    tput.set_title("output tokens / s")
    for ax in (hits, ttft, tput):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        f"serve -dp {part['data_parallel_size']}: medians over {part['rounds']} round(s)",
        fontsize=9,
    )
    return fig


def structured(part: dict):
    fig, (tput, compile_ax, mask_ax) = plt.subplots(1, 3, figsize=(12, 3.8))
    variants = part["summary"]["variants"]
    speeds = [s["output_tokens_per_s"] for s in variants.values()]
    names = [LABELS[v].replace(", ", ",\n") for v in variants]
    _bars(tput, names, speeds, "%.1f", color=["tab:gray", "tab:blue", "tab:green"])
    tput.set_ylim(0, 1.15 * max(speeds))
    tput.set_title("output tokens / s (median)")
    tput.tick_params(axis="x", labelsize=7)
    grammars = part["compile"]["grammars"]
    for kind, marker in (("json", "o"), ("regex", "s"), ("lark", "^")):
        chosen = [g for g in grammars if g["kind"] == kind]
        sizes = [g["grammar_chars"] for g in chosen]
        if chosen:
            cold = [g["cold_ms"] for g in chosen]
            compile_ax.scatter(sizes, cold, marker=marker, label=f"{kind} cold")
        if cached := [min(g["cached_ms"]) for g in chosen if g["cached_ms"]]:
            compile_ax.scatter(sizes, cached, marker=marker, facecolors="none", edgecolors="gray")
    compile_ax.scatter([], [], marker="o", facecolors="none", edgecolors="gray", label="cached")
    compile_ax.set_yscale("log")
    compile_ax.set_xlabel("grammar size (chars)")
    compile_ax.set_title("compile time (ms)")
    compile_ax.legend(fontsize=7)
    m = part["mask_fill"]
    fills = {p: [f["us_per_row"][p] for f in m["fills"].values()] for p in ("p50", "p99")}
    _paired(mask_ax, [k.replace("_", "\n") for k in m["fills"]], fills, 0.4)
    mask_ax.tick_params(axis="x", labelsize=7)
    mask_ax.set_title(f"mask fill, µs per row (parallel: {m['parallel_threads']} threads)")
    mask_ax.legend(fontsize=7)
    fig.suptitle("structured outputs (JSON schema) on one engine", fontsize=9)
    return fig
