"""The report's PNG plots, one per section that has one, from the results (matplotlib,
headless Agg backend); each is written as <docs>/benchmarks/<name>.png."""

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
    written = []
    for key, part, plot in PLOTS:
        if found := part_of(results, key, part):
            written.append(plot(found, folder))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _throughput(tp: dict, folder: Path) -> Path:
    runs = tp["runs"]
    names = [r["name"].replace(" (", "\n(").replace(", static", "\nstatic") for r in runs]
    values = [r["output_tokens_per_s"] for r in runs]
    colors = ["tab:blue" if r["name"].startswith("pagestream") else "tab:gray" for r in runs]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(range(len(runs)), values, color=colors)
    ax.bar_label(bars, fmt="%.0f")
    ax.set_xticks(range(len(runs)), names, fontsize=7)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Offline throughput, same prompts and output lengths")
    return _save(fig, folder / "throughput.png")


def _serving(sv: dict, folder: Path) -> Path:
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(9, 3.6))
    series: dict[tuple[str, str], list[dict]] = {}
    for run in sv["runs"]:
        if run["rate"] != "inf":
            series.setdefault((run["deployment"], run["transport"]), []).append(run)
    for (deployment, transport), runs in series.items():
        rates = [r["rate"] for r in runs]
        label = f"{transport}, {deployment}"
        style = "--" if deployment.startswith("split") else "-"
        ttft.plot(rates, [r["ttft_ms"]["p50"] for r in runs], style, marker="o", label=label)
        tpot.plot(rates, [r["tpot_ms"]["p50"] for r in runs], style, marker="o", label=label)
    for ax, title in ((ttft, "TTFT p50 (ms)"), (tpot, "TPOT p50 (ms)")):
        ax.set_xlabel("request rate (requests/s)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return _save(fig, folder / "serving.png")


def _kv_utilization(mem: dict, folder: Path) -> Path:
    kv = mem["kv_utilization"]
    series = kv.get("series", [])
    fig, ax = plt.subplots(figsize=(8, 3.4))
    if series:
        steps = range(len(series))
        for key, label in (
            ("used", "paged"),
            ("reserved_oracle", "preallocate exact length"),
            ("reserved_max", "preallocate max_model_len"),
        ):
            ax.plot(steps, [s["real"] / s[key] for s in series], label=label)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    ax.set_xlabel("sample (engine steps)")
    ax.set_ylabel("real tokens / allocated slots")
    ax.set_title("KV-cache utilisation over the offline run")
    return _save(fig, folder / "kv_utilization.png")


def _memory(mem: dict, folder: Path) -> Path:
    prefix, share = mem["prefix_caching"], mem["sharing"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = ["prefix cache off", "prefix cache on"]
    bars = left.bar(labels, [prefix["off"]["ttft_mean_ms"], prefix["on"]["ttft_mean_ms"]])
    left.bar_label(bars, fmt="%.0f")
    left.set_ylabel("mean TTFT (ms)")
    left.set_title("Shared system prompt")
    names = ["independent", f"n={share['width']}", f"beam {share['width']}"]
    peaks = [share[k]["peak_blocks"] for k in ("independent", "parallel_sampling", "beam_search")]
    bars = right.bar(names, peaks, color=["tab:gray", "tab:blue", "tab:blue"])
    right.bar_label(bars)
    right.set_ylabel("peak KV blocks")
    right.set_title("Memory sharing")
    return _save(fig, folder / "memory.png")


def _routing(part: dict, folder: Path) -> Path:
    summary = part["summary"]
    names = [s["policy"] for s in summary]
    fig, (hits, ttft, tput) = plt.subplots(1, 3, figsize=(11, 3.6))
    bars = hits.bar(names, [s["hit_rate"] for s in summary], color="tab:blue")
    hits.bar_label(bars, fmt="%.2f")
    hits.axhline(part["best_hit_rate"], color="gray", linestyle="--", label="best possible")
    hits.set_ylim(0, 1)
    hits.set_title("prefix-cache hit rate")
    hits.legend(fontsize=7, loc="lower right")
    x = range(len(names))
    width = 0.38
    for offset, key, label in (
        (-width / 2, "ttft_p50_ms", "p50"),
        (width / 2, "ttft_p99_ms", "p99"),
    ):
        values = [s[key] or 0 for s in summary]
        bars = ttft.bar([i + offset for i in x], values, width, label=label)
        ttft.bar_label(bars, fmt="%.0f", fontsize=7)
    ttft.set_xticks(list(x), names)
    ttft.set_title("TTFT (ms)")
    ttft.legend(fontsize=7)
    bars = tput.bar(names, [s["output_tokens_per_s"] for s in summary], color="tab:green")
    tput.bar_label(bars, fmt="%.1f")
    tput.set_title("output tokens / s")
    for ax in (hits, ttft, tput):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(
        f"serve -dp {part['data_parallel_size']}: medians over {part['rounds']} round(s)",
        fontsize=9,
    )
    return _save(fig, folder / "routing.png")


def _structured(part: dict, folder: Path) -> Path:
    fig, (tput, compile_ax, mask_ax) = plt.subplots(1, 3, figsize=(12, 3.8))
    _plot_throughput(tput, part)
    _plot_compile(compile_ax, part)
    _plot_masks(mask_ax, part)
    fig.suptitle("structured outputs (JSON schema) on one engine", fontsize=9)
    return _save(fig, folder / "structured.png")


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


# (results key, part or None for the whole section, plot)
PLOTS = (
    ("throughput", None, _throughput),
    ("serving", None, _serving),
    ("memory", None, _kv_utilization),
    ("memory", None, _memory),
    ("routing", "dp2", _routing),
    ("structured", "offline", _structured),
)
