"""The "Structured outputs" section of docs/benchmarks.md, from the `structured` results
(benchmarks/structured.py; its plot: benchmarks/plots.py)."""

from __future__ import annotations

import json

from benchmarks.markdown import columns, measured, table

HEADING = "## Structured outputs"
LABELS = {
    "unconstrained": "unconstrained",
    "json_schema": "JSON schema",
    "matched_length": "no grammar, constrained lengths",
}
GOAL = 0.9  # constrained / unconstrained output tok/s the issue asks for


def structured_section(part: dict) -> list[str]:
    machine = part.get("meta", {}).get("machine", {})
    cores, torch = machine.get("cores"), machine.get("torch")
    return [
        HEADING,
        "",
        measured(
            part,
            "pagestream bench structured --profile quick",
            f"{cores} cores, torch {torch} with {part.get('torch_threads')} thread(s)",
        )
        + " The machine is shared with other jobs, so the figures are noisy: compare the runs "
        "within this section, measured side by side, not with other sections.",
        "",
        "### Throughput, unconstrained vs a JSON schema",
        "",
        _workload_words(part),
        "",
        "```json",
        json.dumps(part["schema"]),
        "```",
        "",
        _throughput_table(part),
        "",
        *_ratio_lines(part),
        "",
        _validity_words(part),
        "",
        "### Where the time goes",
        "",
        _time_table(part),
        "",
        *_findings(part),
        "",
        "### Grammar compile time",
        "",
        _compile_words(part),
        "",
        _compile_table(part),
        "",
        "### Mask fill per row",
        "",
        _mask_words(part),
        "",
        _mask_table(part),
        "",
        "![structured outputs](benchmarks/structured.png)",
        "",
    ]


def _workload_words(part: dict) -> str:
    w, s = part["workload"], part["summary"]["variants"]
    rounds = s["json_schema"]["runs"]
    return (
        f"`LLM.generate` on {w['num_prompts']} chat prompts ({w['prompt_tokens']} prompt "
        "tokens) that each ask for a JSON record of a person (name, age, role, up to 3 "
        f"skills, active), temperature {w['temperature']} with a fixed seed per prompt, "
        f"max_tokens {w['max_tokens']}; the constrained run adds "
        '`structured_outputs={"json": schema}` with the schema below ('
        + (
            "compact JSON: `disable_any_whitespace`"
            if w.get("compact_json")
            else "the default bounded JSON whitespace"
        )
        + "). The third run has no grammar and holds every request to the length of "
        "its output in the previous constrained run (ignore_eos): the same steps and batch "
        "sizes, so it isolates what the grammar costs from the fact that constrained outputs "
        "stop at the closing brace. The grammar is compiled in a warm-up, so the timed "
        "constrained runs use the cached matcher, and the prefix cache is emptied before "
        f"every run. Medians over {rounds} round(s), the runs in a rotated order each round."
    )


def _runs(part: dict) -> list[dict]:
    return [{"run": LABELS[v], **s} for v, s in part["summary"]["variants"].items()]


def _throughput_table(part: dict) -> str:
    return columns(
        _runs(part),
        {
            "run": "run",
            "output tok/s": "output_tokens_per_s",
            "req/s": "requests_per_s",
            "ms per output token": "ms_per_output_token",
            "mean output len": "mean_output_len",
            "steps": "num_steps",
            "mean seqs per step": "mean_seqs_per_step",
            "decode step ms (p50)": "decode_wall_ms",
            "seconds": "seconds",
            "finish reasons (all rounds)": lambda s: ", ".join(
                f"{k} {n}" for k, n in sorted(s["finish_reasons"].items())
            ),
        },
    )


def _ratio_lines(part: dict) -> list[str]:
    ratios = part["summary"]["ratios"]
    out = []
    for other, words in (
        ("unconstrained", f"the issue's goal: >= {GOAL}x output tok/s"),
        ("matched_length", "the grammar's own cost, at equal work"),
    ):
        r = ratios[other]
        verdict = ""
        if other == "unconstrained":
            verdict = " (met)" if r["output_tokens_per_s"] >= GOAL else " (not met)"
        out.append(
            f"- JSON schema / {LABELS[other]} ({words}): output tok/s "
            f"**x{r['output_tokens_per_s']}**{verdict}, req/s x{r['requests_per_s']}, "
            f"ms per output token x{r['ms_per_output_token']}."
        )
    return out


def _validity_words(part: dict) -> str:
    s = part["summary"]["variants"]
    ours, free = s["json_schema"]["valid"], s["unconstrained"]["valid"]
    outputs = s["json_schema"]["outputs"]
    text = (
        f"Validity (json.loads + jsonschema against the schema, all rounds): constrained, "
        f"{ours['stopped_valid']} of the {ours['stopped']} outputs that finished with stop "
        f"({ours['valid']} of all {outputs}; an output cut at max_tokens is an unfinished "
        f"object); unconstrained, {free['valid']} of {s['unconstrained']['outputs']}."
    )
    example = part.get("example_output")
    if example:
        text += f" A constrained output: `{' '.join(example.split())}`"
    return text


def _time_table(part: dict) -> str:
    return columns(
        _runs(part),
        {
            "run": "run",
            "decode forward ms (p50)": "decode_forward_ms",
            "decode sample ms (p50)": "decode_sample_ms",
            "masks() ms per step": "masks_ms_per_step",
            "masks() µs per row": "masks_us_per_row",
            "masks() % of run": lambda s: round(100 * s["masks_share"], 2),
            "accept µs per token": "accept_us_per_token",
            "forward s (run)": "total_forward_s",
            "sample s (run)": "total_sample_s",
        },
    )


def _findings(part: dict) -> list[str]:
    """Sentences computed from the medians (no hand-written numbers)."""
    s = part["summary"]["variants"]
    ours, free, same = s["json_schema"], s["unconstrained"], s["matched_length"]
    ratio = part["summary"]["ratios"]
    lines = []
    if ours["mean_output_len"] < free["mean_output_len"]:
        lines.append(
            f"- Batch shape: the constrained outputs average {ours['mean_output_len']} tokens "
            f"against {free['mean_output_len']} unconstrained, yet the runs take "
            f"{ours['num_steps']} and {free['num_steps']} steps (a run lasts as long as its "
            f"longest output): {ours['mean_seqs_per_step']} sequences per step against "
            f"{free['mean_seqs_per_step']}. A step's cost grows less than linearly with its "
            "sequences, so fewer tokens per step means fewer tokens per second, grammar or "
            "not: compare with the run held to the same lengths."
        )
    lines += [
        f"- Grammar cost at equal work (same lengths, same steps): output tok/s "
        f"x{ratio['matched_length']['output_tokens_per_s']}. The scheduler's `masks()` takes "
        f"{ours['masks_ms_per_step']} ms per step ({ours['masks_us_per_row']} µs per row, "
        f"{round(100 * ours['masks_share'], 2)}% of the run, outside the step) and `accept` "
        f"{ours['accept_us_per_token']} µs per token. A decode step takes "
        f"{ours['decode_wall_ms']} ms at the median against {same['decode_wall_ms']} ms "
        f"without a grammar; most of the difference is the worker's sampling "
        f"({ours['decode_sample_ms']} ms against {same['decode_sample_ms']} ms), where the "
        "bitmask is unpacked and applied to the logits, next to a "
        f"{ours['decode_forward_ms']} ms forward pass.",
    ]
    mask = part["mask_fill"]
    speedup = mask["parallel_speedup"]
    lines.append(
        f"- Filling the rows in parallel (llguidance's LLExecutor, {mask['parallel_threads']} "
        f"threads) instead of one after another, on the replayed steps below: "
        f"x{speedup['cold']} with a freshly compiled grammar, x{speedup['warm']} warm."
    )
    return lines


def _compile_words(part: dict) -> str:
    c = part["compile"]
    kinds = ", ".join(f"{v['count']} {k}" for k, v in c["summary"]["by_kind"].items())
    return (
        "On a fresh StructuredOutputManager with the model's tokenizer (vocabulary "
        f"{c['vocab_size']}; building llguidance's tokenizer took {c['tokenizer_build_s']} s, "
        f"once per engine, not counted below). Grammars: {kinds} (JSON schemas of 2 to "
        f"{1 + c['summary']['by_kind'].get('json', {}).get('count', 1)} properties of rotating "
        "kinds: strings with maxLength, bounded integers, numbers, booleans, enums, arrays "
        "with maxItems, patterns, nested objects). Cold: `admit` of a grammar never seen "
        "until its matcher is ready (compiled on the manager's thread); cached: the same "
        "grammar admitted again (a copy of the cached matcher); first mask: the `masks()` "
        "call right after. llguidance builds its lexer states lazily, so part of a new "
        "grammar's cost is paid in its first masks of each new state (the mask fill p99 "
        "below). Times in ms."
    )


def _compile_table(part: dict) -> str:
    s = part["compile"]["summary"]
    rows = [
        ["cold compile", *_pcts(s["cold_ms"])],
        ["cold: first mask", *_pcts(s["cold_first_mask_ms"])],
        ["cached (copy of the matcher)", *_pcts(s["cached_ms"])],
        ["cached: first mask", *_pcts(s["cached_first_mask_ms"])],
    ]
    rows += [[f"cold compile, {k} only", *_pcts(v["cold_ms"])] for k, v in s["by_kind"].items()]
    return table(["", "p50", "p99", "max", "n"], rows)


def _pcts(p: dict) -> list:
    return [*(round(p[k], 3) if k in p else None for k in ("p50", "p99", "max")), p.get("n")]


def _mask_words(part: dict) -> str:
    m, count = part["mask_fill"], part["workload"]["num_prompts"]
    return (
        f"The last constrained run's {count} outputs replayed in lockstep "
        f"({m['positions']} positions, {m['rows']} rows): at each position the rows still "
        "going get their bitmask from the scheduler's `masks()` (one row after another, as "
        f"in a step), or from an LLExecutor with {m['parallel_threads']} threads "
        "(`fill_next_token_bitmask_par`). Each on a fresh manager: cold (a fresh tokenizer "
        "and compile, so llguidance's caches start empty) and then warm (new matchers from "
        "the same compiled grammar after the cold replay, as in an engine that has served "
        "the schema for a while). The slow rows (the p99) are states inside a JSON string, "
        "where nearly the whole vocabulary is allowed: timed one by one, such a row costs "
        "about the same cold or warm, a structural state (a key, a number, punctuation) a "
        f"fraction of it. Bitmasks that differ from the first replay's: "
        f"{m['bitmask_mismatches']}; tokens rejected on replay: {m['tokens_rejected']}."
    )


def _mask_table(part: dict) -> str:
    m = part["mask_fill"]
    fills = []
    for key, fill in m["fills"].items():
        kind, state = key.split("_")
        label = "`masks()` (serial)" if kind == "serial" else None
        label = label or f"LLExecutor ({m['parallel_threads']} threads)"
        fills.append({"fill": label, "caches": state, **fill})
    return columns(
        fills,
        {
            "fill": "fill",
            "caches": "caches",
            "µs per row p50": lambda f: round(f["us_per_row"]["p50"], 1),
            "µs per row p99": lambda f: round(f["us_per_row"]["p99"], 1),
            "ms per step p50": lambda f: round(f["ms_per_step"]["p50"], 3),
            "ms per step p99": lambda f: round(f["ms_per_step"]["p99"], 3),
            "ms in all": lambda f: round(f["total_s"] * 1e3, 1),
        },
    )
