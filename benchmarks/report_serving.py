"""The report's "Online serving" section (benchmarks/serving.py): each deployment, transport
and rate, and the cost of `--split-services`."""

from __future__ import annotations

from benchmarks.markdown import table


def serving_section(sv: dict) -> list[str]:
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
        table(
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
            table(
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
