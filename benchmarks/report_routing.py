"""The report's section for `pagestream bench routing` (benchmarks/routing.py): each router
policy's prefix-cache hit rate, requests per replica, latencies and throughput (its plot:
benchmarks/plots.py)."""

from __future__ import annotations

from benchmarks.markdown import columns, measured
from benchmarks.routing import hit_rate_bound

HEADING = "## Routing across data-parallel replicas"


def routing_section(part: dict) -> list[str]:
    w, kv = part["workload"], part["kv_cache"]
    out = [
        HEADING,
        "",
        measured(part, "pagestream bench routing --profile quick")
        + " The machine is shared with other jobs and both replicas (and the frontend and the "
        "client) share its cores, so latencies and throughput are noisy: compare the policies "
        "within this run, measured side by side, not with other sections.",
        "",
        f"`pagestream serve -dp {part['data_parallel_size']} --router-policy P`, a fresh server "
        f"per policy and round. Workload: {w['conversations']} conversations x {w['turns']} "
        f"turns = {w['num_requests']} requests; every turn of a conversation is its "
        f"{w['system_prompt_len']}-token system prompt plus a {w['question_len']}-token question "
        f"of its own, {w['output_len']} output tokens (greedy, ignore_eos), "
        f"{w['prompt_tokens']} prompt tokens in all. The turns of all conversations go in one "
        f"seeded shuffled order at a fixed concurrency of {w['concurrency']} (closed loop: a "
        f"client sends its next request when its last one ends) over {w['transport']}. "
        f"KV cache per replica: {kv['blocks_per_replica']} blocks of {kv['block_size']} tokens "
        f"(`--kv-cache-memory {kv['kv_cache_memory']}`, float32), "
        + _kv_words(part)
        + f" Each replica's worker runs {part['threads_per_replica']} torch thread(s). "
        "Hit rate: prefix-cache hits / queries (prompt tokens) over both replicas, from the "
        "frontend's /metrics after a warm-up and after the run; the best any policy can reach "
        f"(each conversation's prefix computed once) is {part['best_hit_rate']}. "
        f"Figures are medians over {part['rounds']} round(s) (policies in a rotated order each "
        "round); times in ms.",
        "",
        columns(
            part["summary"],
            {
                "policy": lambda s: f"`{s['policy']}`",
                "hit rate": "hit_rate",
                "requests per replica (each round)": lambda s: ", ".join(
                    " / ".join(map(str, counts)) for counts in s["requests_per_engine"]
                ),
                "TTFT p50": "ttft_p50_ms",
                "TTFT p99": "ttft_p99_ms",
                "ITL p50": "itl_p50_ms",
                "ITL p99": "itl_p99_ms",
                "E2E p50": "e2e_p50_ms",
                "E2E p99": "e2e_p99_ms",
                "output tok/s": "output_tokens_per_s",
                "req/s": "requests_per_s",
                "seconds": "duration_s",
                "failed": "failures",
            },
        ),
        "",
        "Every run, side by side (round, policy; router decisions per replica by reason):",
        "",
        columns(
            part["runs"],
            {
                "round": "round",
                "policy": lambda r: f"`{r['policy']}`",
                "hit rate": "hit_rate",
                "per replica": _engines_cell,
                "TTFT p50": lambda r: r["ttft_ms"]["p50"],
                "TTFT p99": lambda r: r["ttft_ms"]["p99"],
                "output tok/s": "output_tokens_per_s",
                "seconds": "duration_s",
                "load avg": "load_average",
            },
        ),
        "",
        "![routing](benchmarks/routing.png)",
        "",
        *_observations(part),
        "",
    ]
    return out


def _kv_words(part: dict) -> str:
    w, kv = part["workload"], part["kv_cache"]
    held = kv["conversations_held"]
    if held >= w["conversations"]:
        return "enough for every conversation on both replicas (no eviction)."
    spread = hit_rate_bound(
        w["conversations"], w["turns"], w["system_prompt_len"], w["question_len"], computed=2
    )
    return (
        f"room for the requests of {held:g} of the {w['conversations']} conversations "
        f"({kv['blocks_per_request']} blocks each, {kv['prefix_blocks_per_conversation']} of "
        "them the shared system prompt): a policy that keeps each conversation on one replica "
        "keeps its share cached, one that spreads them over both evicts and recomputes "
        "(with nothing evicted, computing every prefix once on each replica would still "
        f"give a hit rate of {spread})."
    )


def _engines_cell(r: dict) -> str:
    return "; ".join(
        f"{name}: {e['requests']} ("
        + ", ".join(f"{reason} {n}" for reason, n in e["reasons"].items())
        + f"), hit rate {e['hit_rate']}"
        for name, e in r["engines"].items()
    )


def _observations(part: dict) -> list[str]:
    """Sentences computed from the medians (no hand-written numbers)."""
    by = {s["policy"]: s for s in part["summary"]}
    aware = by.get("cache_aware")
    if not aware:
        return []
    lines = []
    for other in ("round_robin", "least_loaded"):
        base = by.get(other)
        if not base:
            continue
        parts = [f"hit rate {aware['hit_rate']} vs {base['hit_rate']}"]
        for key, label in (
            ("ttft_p50_ms", "TTFT p50"),
            ("ttft_p99_ms", "TTFT p99"),
            ("output_tokens_per_s", "output tok/s"),
        ):
            if aware[key] and base[key]:
                parts.append(f"{label} x{aware[key] / base[key]:.2f}")
        lines.append(f"- `cache_aware` against `{other}`: " + ", ".join(parts) + ".")
    return lines
