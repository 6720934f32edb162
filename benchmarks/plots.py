"""PNG plots of the benchmark results (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

DPI = 110


def write_plots(results: dict, folder: Path) -> list[Path]:
    written = []
    for key, plot in (
        ("throughput", _throughput),
        ("serving", _serving),
        ("memory", _kv_utilization),
        ("memory", _memory),
    ):
        if results.get(key):
            written.append(plot(results[key], folder))
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
