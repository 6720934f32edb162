"""The report's section for `pagestream bench parallel`: layouts side by side, where a step's
time goes under tensor / pipeline parallelism, and async scheduling on vs off."""

from __future__ import annotations

from pathlib import Path

from benchmarks.markdown import columns, measured, table

# What the runs say, written by hand and dated inside (rendered after the tables).
PARALLEL_NOTES = Path(__file__).parent / "data" / "parallel_notes.md"


def parallel_section(par: dict) -> list[str]:
    out = [
        "## Parallel runs: tensor / pipeline parallelism and async scheduling",
        "",
        "Each part below was measured in one run whose command, date and machine it names; "
        "the machine is shared with other jobs (its load average is given), so compare "
        "figures within a part, which were measured side by side, not across parts or "
        "with the sections above. Every comparison takes turns over several rounds and "
        "gives the median of each round's ratio and the ratio of the best rounds (other "
        "jobs only ever slow a run down, so the best round is the least disturbed one).",
        "",
    ]
    if par.get("offline"):
        out += _offline(par["offline"])
    if par.get("offline") or par.get("async_serving"):
        out += _async(par.get("offline"), par.get("async_serving"))
    if PARALLEL_NOTES.exists():
        out += [PARALLEL_NOTES.read_text(encoding="utf-8").strip(), ""]
    return out


def _provenance(part: dict) -> str:
    return measured(part, "pagestream bench parallel --profile quick")


def _best_ratio(run: dict, runs: list[dict], label: str) -> float | None:
    """The best round of ``run`` over the best round of ``label`` on the same model."""
    base = next((r for r in runs if r["model"] == run["model"] and r["layout"] == label), None)
    if base is None:
        return None
    best = max(run["output_tokens_per_s_rounds"])
    return round(best / max(base["output_tokens_per_s_rounds"]), 3)


def _pair(median, best) -> str | None:
    return None if median is None else f"{median}; {best}"


def _step_cell(step: dict) -> str:
    if not step.get("num_steps"):
        return "—"
    return f"{step['wall_ms']} / {step['forward_ms']}"


def _in_step_cell(step: dict, table: dict) -> float | str | None:
    """The in-step estimate, where the step's size is within the sizes timed in a step."""
    sizes = [int(n) for n in table.get("all_reduce_in_step_us", {})]
    estimate = step.get("collectives_in_step_est_ms")
    if estimate is None or not sizes or step["median_tokens"] <= max(sizes):
        return estimate
    return f"(beyond {max(sizes)} tokens)"


def _collectives_cell(step: dict) -> str | None:
    """The collectives' estimate at the idle-process minimum ... median timings."""
    median, low = step.get("collectives_est_ms"), step.get("collectives_min_est_ms")
    if median is None:
        return None
    return median if low is None else f"{low}–{median}"


def _offline(off: dict) -> list[str]:
    runs = off["runs"]
    identical = off["num_requests"]
    layouts = columns(
        runs,
        {
            "layout": "layout",
            "model": "model",
            "worker processes": lambda r: r["processes"] or "in process",
            "output tok/s (median; best)": lambda r: _pair(
                r["output_tokens_per_s"], max(r["output_tokens_per_s_rounds"])
            ),
            "vs tp=1 (median; best)": lambda r: _pair(
                r["vs_tp1"], _best_ratio(r, runs, "tp=1 (in process)")
            ),
            "vs tp=1 worker process (median; best)": lambda r: _pair(
                r.get("vs_tp1_worker_process"), _best_ratio(r, runs, "tp=1 (worker process)")
            ),
            "identical outputs": lambda r: (
                None if r["identical_outputs"] is None else f"{r['identical_outputs']}/{identical}"
            ),
            "steps": "steps_per_run",
            "seqs per decode step": lambda r: r["steps"].get("decode", {}).get("median_seqs"),
            "decode step ms": lambda r: _step_cell(r["steps"].get("decode", {})),
            "prefill step ms": lambda r: _step_cell(r["steps"].get("prefill", {})),
        },
    )
    out = [
        "### Offline throughput by layout",
        "",
        _provenance(off),
        "",
        f"{off['num_requests']} requests ({off['prompt_tokens']} prompt tokens, "
        f"{off['output_tokens']} output tokens), greedy with ignore_eos, prefix caching off, "
        f"{off['dtype']}, through `LLM.generate`. The layouts take turns (each engine "
        f"started, warmed up, timed and stopped in its turn), {off['rounds']} round(s): "
        "output tok/s is the median over rounds; the best round, `vs tp=1` the median of each "
        "round's ratio to tp = 1 in process on the same model; the ratio of the best rounds (and "
        "the same against tp = 1 in one worker process, the same model runner behind the same "
        "gRPC stream as a worker group's ranks). Identical outputs: requests whose tokens equal "
        "that tp = 1 run's. Steps: plans per run; seqs per decode step: the median. Step figures "
        "come from each layout's best round. Step times are medians in ms: wall (the scheduler's "
        "submit to result) / forward (the output rank's). A worker process gets cores / world "
        "size torch threads (tp = 3: one thread each, three processes on the cores); pp = 2 "
        "keeps two plans in flight.",
        "",
        layouts,
        "",
    ]
    for name, model in off["models"].items():
        if name != "model":
            out += [
                f"`{name}`: the model's sizes with {model['num_attention_heads']} query heads "
                f"of {model['head_dim']} and {model['num_key_value_heads']} KV heads, random "
                f"weights (the model itself refuses: {model['refused']})",
                "",
            ]
    for skipped in off.get("skipped", []):
        out += [f"Not run: {skipped['layout']}: {skipped['reason']}", ""]
    out += _where_time_goes(off)
    out += _collectives(off["collectives"])
    return out


def _where_time_goes(off: dict) -> list[str]:
    """Per tp/pp run: its forward against tp = 1's on the same steps, and the estimate."""
    runs = off["runs"]
    rows = []
    for run in runs:
        if run["tp"] == 1 and run["pp"] == 1:
            continue
        base = _step_baseline(run, runs)
        for kind in ("decode", "prefill"):
            step = run["steps"].get(kind, {})
            base_step = (base or {}).get("steps", {}).get(kind, {})
            if not step.get("num_steps") or not base_step.get("num_steps"):
                continue
            rows.append({"run": run, "base": base, "kind": kind, "step": step, "tp1": base_step})
    if not rows:
        return []
    counts = "; ".join(
        f"{r['layout']}: " + ", ".join(f"{n} {k}" for k, n in r["collectives_per_step"].items())
        for r in runs
        if r["collectives_per_step"]
    )
    return [
        "### Where a step's time goes",
        "",
        "Median decode-only and prefill-carrying steps of each layout's best round (the "
        "scheduler makes the same plans in every layout with one plan in flight), ms, against "
        "tp = 1 in a worker process where it ran (the same process set-up as a rank), else in "
        "process: the output rank's forward at tp = 1 and in the layout, the difference, the "
        "collectives' estimates (the output rank's collectives per step at "
        "the step's size, from the timings below: between idle processes at their "
        "minimum–median, and with the all-reduces timed inside a step), "
        "the transport (wall minus the output rank's own time), and the step's wall at "
        "tp = 1 and in the layout. Under pp the output rank is the last stage: its forward "
        "is half the layers plus its wait for the first stage's hidden states, and with "
        "two plans in flight a plan's wall includes its wait behind the other. "
        f"Collectives per step: {counts}.",
        "",
        columns(
            rows,
            {
                "layout": "run.layout",
                "against": "base.layout",
                "step": "kind",
                "tokens": "step.median_tokens",
                "tp=1 forward": "tp1.forward_ms",
                "forward": "step.forward_ms",
                "difference": lambda r: round(r["step"]["forward_ms"] - r["tp1"]["forward_ms"], 2),
                "collectives, idle (est.)": lambda r: _collectives_cell(r["step"]),
                "collectives, in a step (est.)": lambda r: _in_step_cell(
                    r["step"], off["collectives"].get(str(r["run"]["tp"]), {})
                ),
                "transport": "step.transport_ms",
                "tp=1 wall": "tp1.wall_ms",
                "wall": "step.wall_ms",
            },
        ),
        "",
    ]


def _step_baseline(run: dict, runs: list[dict]) -> dict | None:
    same = [r for r in runs if r["model"] == run["model"] and r["tp"] == r["pp"] == 1]
    for label in ("tp=1 (worker process)", "tp=1 (in process)"):
        found = next((r for r in same if r["layout"] == label), None)
        if found is not None:
            return found
    return None


def _collectives(collectives: dict) -> list[str]:
    if not collectives:
        return []
    sizes = sorted(collectives)
    first = collectives[sizes[0]]
    header = ["tokens x hidden"] + [f"all_reduce, {w} processes" for w in sizes]
    header += ["send/recv (stage to stage)"]
    rows = []
    for n in first["all_reduce_us"]:
        row = [f"{n} x {first['hidden_size']}"]
        row += [_us(collectives[w]["all_reduce_us"].get(n)) for w in sizes]
        row.append(_us(first["send_recv_us"].get(n)))
        rows.append(row)
    gather_rows = [
        [f"{n} x {first['vocab_size']}/{w}", _us(collectives[w]["gather_logits_us"].get(n))]
        for w in sizes
        for n in collectives[w]["gather_logits_us"]
    ]
    in_step = [
        [
            w,
            f"{n} x {collectives[w]['hidden_size']}",
            e["without_ms"],
            e["with_ms"],
            e["per_call"],
        ]
        for w in sizes
        for n, e in collectives[w].get("all_reduce_in_step_us", {}).items()
    ]
    in_step_text = []
    if in_step:
        in_step_text = [
            f"Inside a step: each process runs the model's {first['num_layers']} layers of "
            "linears on its shard of the weights, without and with the two all-reduces per "
            "layer, turn about (medians, ms); the difference per all-reduce (us) is what one "
            "costs between busy processes, wake-ups and the peer's lag included:",
            "",
            table(
                ["processes", "tokens x hidden", "step without", "step with", "per all-reduce"],
                in_step,
            ),
            "",
        ]
    return [
        "### What one collective costs here (gloo, float32)",
        "",
        f"`python -m benchmarks.collectives`: {first['repeats']} barrier-aligned calls per "
        "size between idle local processes (each with cores / processes torch threads), "
        "median (minimum) in microseconds. In a real step a rank also waits for its slowest "
        "peer, so the forward-time difference above can exceed the estimate.",
        "",
        table(header, rows),
        "",
        table(["logits gathered to rank 0 (rows x vocab shard)", "gather"], gather_rows),
        "",
        *in_step_text,
    ]


def _us(entry: dict | None) -> str | None:
    return None if entry is None else f"{entry['median']} ({entry['min']})"


def _async(off: dict | None, sv: dict | None) -> list[str]:
    out = ["### Async scheduling on vs off", ""]
    offline = [r for r in (off or {}).get("runs", []) if "async scheduling" in r["layout"]]
    for run in offline:
        sync = next(
            (
                r
                for r in off["runs"]
                if r["model"] == run["model"]
                and r["layout"] == run["layout"].removesuffix(", async scheduling")
            ),
            None,
        )
        if sync is None:
            continue
        best = _best_ratio(run, off["runs"], sync["layout"])
        out += [
            f"Offline (`LLM.generate`, the runs above): {run['layout']} / without: "
            f"**{run['vs_tp1']}x** output tok/s (best rounds: {best}x), in "
            f"{run['steps_per_run']} steps against "
            f"{sync['steps_per_run']}, {run['steps']['decode'].get('median_seqs')} sequences "
            f"per decode step against {sync['steps']['decode'].get('median_seqs')} (a request "
            "is never in two plans in flight, so the running batch alternates between two "
            "halves).",
            "",
        ]
    if sv:
        out += _async_serving(sv)
    return out


def _async_serving(sv: dict) -> list[str]:
    ratio_rows = [
        [
            r["deployment"],
            r["rate"],
            r["rounds"],
            *(_pair(r[k], r.get(f"{k}_best")) for k in ("throughput", "ttft_p50", "tpot_p50")),
        ]
        for r in sv["ratios"]
    ]
    return [
        "Serving. " + _provenance(sv),
        "",
        "`pagestream serve` with and without `--async-scheduling`, in one process and with "
        "`--split-services`: both servers of a deployment up side by side, taking turns "
        f"over {sv['rounds']} round(s); {sv['num_requests']} requests ({sv['prompt_tokens']} "
        f"prompt tokens, {sv['output_tokens']} output tokens, ignore_eos) over gRPC, prefix "
        "caching off. Ratios on / off (median of each round's ratio; ratio of the best "
        "rounds). Throughput above 1 and latencies below 1 favour async scheduling:",
        "",
        table(["deployment", "rate", "rounds", "throughput", "TTFT p50", "TPOT p50"], ratio_rows),
        "",
        columns(
            sv["runs"],
            {
                "deployment": "deployment",
                "async": lambda r: "on" if r["async_scheduling"] else "off",
                "round": "round",
                "rate": "rate",
                "done": "completed",
                "failed": "failures",
                "output tok/s": "output_tokens_per_s",
                "TTFT p50 ms": lambda r: r["ttft_ms"]["p50"],
                "TPOT p50 ms": lambda r: r["tpot_ms"]["p50"],
                "ITL p50 ms": lambda r: r["itl_ms"]["p50"],
            },
        ),
        "",
    ]
