"""The report's "Online serving" section (benchmarks/serving.py): each deployment, transport
and rate, and the cost of `--split-services`."""

from __future__ import annotations

from benchmarks.markdown import columns


def serving_section(sv: dict) -> list[str]:
    out = [
        "## Online serving",
        "",
        f"{sv['num_requests']} requests ({sv['prompt_tokens']} prompt tokens, "
        f"{sv['output_tokens']} output tokens, ignore_eos) per run, Poisson arrivals at each "
        "rate (requests/s; `inf` sends all at once: saturated throughput), prefix caching "
        "off (every run reuses the prompts). Times in ms.",
        "",
        columns(
            sv["runs"],
            {
                "deployment": "deployment",
                "transport": "transport",
                "rate": "rate",
                "done": "completed",
                "failed": "failures",
                "output tok/s": "output_tokens_per_s",
                **{
                    f"{m} {p}": f"{m.lower()}_ms.{p}"
                    for m in ("TTFT", "TPOT", "ITL")
                    for p in ("p50", "p99")
                },
            },
        ),
        "",
    ]
    if sv.get("split_ratios"):
        out += [
            "Cost of `--split-services` (split / one process, same transport and rate; "
            "target: throughput within 10%):",
            "",
            columns(
                sv["split_ratios"],
                {
                    "transport": "transport",
                    "rate": "rate",
                    "throughput": "throughput",
                    "TTFT p50": "ttft_p50",
                    "TPOT p50": "tpot_p50",
                },
            ),
            "",
        ]
    out += ["![serving latency](benchmarks/serving.png)", ""]
    return out
