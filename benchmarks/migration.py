"""migrate(results): results.json as the report reads it (benchmarks/report.py). Records written
before the one row schema (benchmarks/row.py) get its names, and figures the old per-section
renderers computed from the recorded ones (they were never stored) are computed the same way
and kept beside them, so that every record, old or new, renders with all its figures."""

from __future__ import annotations

import copy

from benchmarks.routing import hit_rate_bound

RENAMED = {"vs_none": "vs_baseline", "vs_base": "vs_baseline"}  # the A/B rows' ratios
RENAMED |= {f"tpot_{old}": f"tpot_{new}" for old, new in RENAMED.items()} | {"config": "variant"}


def migrate(results: dict) -> dict:
    results = copy.deepcopy(results)
    for part in _parts(results, "speculative", "lora"):
        for row in part.get("runs", []) + part.get("chat", []):
            row.update({RENAMED.get(k, k): row.pop(k) for k in list(row)})
    kv = (results.get("memory") or {}).get("kv_utilization", {})
    if kv.get("num_samples"):
        kv.setdefault("waste", {k: round(1 - kv[k], 4) for k in ALLOCATIONS})
    for part in _parts(results, "routing"):
        w = part["workload"]
        shape = (w["conversations"], w["turns"], w["system_prompt_len"], w["question_len"])
        part["kv_cache"].setdefault("spread_hit_rate", hit_rate_bound(*shape, computed=2))
    _step_differences((results.get("parallel") or {}).get("offline", {}).get("runs", []))
    return results


ALLOCATIONS = ("paged", "prealloc_max", "prealloc_oracle")
TP1 = ("tp=1 (worker process)", "tp=1 (in process)")  # the step baselines, first found


def _parts(results: dict, *keys: str) -> list[dict]:
    return [p for key in keys for p in (results.get(key) or {}).values() if isinstance(p, dict)]


def _step_differences(runs: list[dict]) -> None:
    """Each tp / pp run's step forward minus tp = 1's on the same model and steps (tp = 1 in
    a worker process where it ran, the same process set-up as a rank)."""
    for run in runs:
        same = [r for r in runs if r["model"] == run["model"] and r["layout"] in TP1]
        same.sort(key=lambda r: TP1.index(r["layout"]))
        if run["tp"] == run["pp"] == 1 or not same:
            continue
        for kind in ("decode", "prefill"):
            step, base = run["steps"].get(kind, {}), same[0]["steps"].get(kind, {})
            if step.get("num_steps") and base.get("num_steps"):
                step.setdefault("tp1_layout", same[0]["layout"])
                step.setdefault("tp1_forward_ms", base["forward_ms"])
                step.setdefault(
                    "forward_minus_tp1_ms", round(step["forward_ms"] - base["forward_ms"], 2)
                )
