"""The report's section for `pagestream bench speculative` (benchmarks/speculative.py)."""

from __future__ import annotations

from benchmarks.markdown import columns, measured

HEADING = "## Speculative decoding (CPU)"
WORKLOADS = {
    "copy": "Copy-heavy: correct, edit, reformat or summarise with quotes a given text",
    "default": "The default workload's synthetic prompts",
}


def speculative_section(part: dict) -> list[str]:
    out = [HEADING, "", _words(part)]
    for name, workload in part["workloads"].items():
        runs = [r for r in part["runs"] if r["workload"] == name]
        out += ["", f"### {WORKLOADS.get(name, name)}", "", _workload_words(workload), ""]
        out.append(_table(runs))
    return out


def _words(part: dict) -> str:
    lookup_min, lookup_max = part["prompt_lookup"]
    return (
        measured(part, "pagestream bench speculative", f"{part['threads']} threads")
        + f" Greedy, through `LLM.generate` with the target in {part['dtype']}; batch B: B "
        f"requests per generate call (batch 1: one after the other), at least "
        f"{part['num_requests']} requests per run. Each of {part['rounds']} round(s) runs "
        "every configuration on an engine of its own (no prefix caching), in a rotated "
        "order; figures are medians over the rounds, ratios the median of each round's ratio "
        "to the same round's run without speculation. TPOT: per request, first to last token "
        "over its tokens - 1, the median request. ngram: prompt_lookup_min "
        f"{lookup_min}, max {lookup_max}. {_draft_words(part)} Every configuration proposes "
        f"at every batch (disable_by_batch_size {part['forced_disable']}) except the rows "
        f"marked default (the engine's disable_by_batch_size {part['default_disable']}: no "
        "proposals while a step runs that many sequences). Acceptance: accepted / proposed "
        "tokens and accepted proposals per draft (spec_decode_* counters over the rounds); "
        "per position: the share of drafts whose proposal there was accepted. Outputs ≠: "
        "requests whose greedy tokens differ from the run without speculation's."
    )


def _draft_words(part: dict) -> str:
    draft = part["draft"]
    text = (
        "draft target: the target itself as its draft (every proposal accepted; what the "
        "mechanics cost)."
    )
    if draft.get("file"):
        size = draft.get("weight_bytes")
        held = f", {size / 1e6:.1f} MB resident" if size else ""
        kind = draft.get("quantization")
        kind = f"{kind} blocks kept" if kind and kind != "none" else "float weights"
        text += (
            f" The draft pair: {draft['file']} ({kind}{held}) for the target's "
            f"{part['target_weight_bytes'] / 1e6:.1f} MB."
        )
    if draft.get("note"):
        text += f" Draft {draft['choice']}: {draft['note']}."
    return text


def _workload_words(workload: dict) -> str:
    eos = "ignore_eos" if workload["ignore_eos"] else "stopping at EOS"
    return (
        f"Prompts of {workload['prompt_min']}..{workload['prompt_max']} tokens (median "
        f"{workload['prompt_median']}), up to {workload['max_tokens']} output tokens, {eos}."
    )


def _per_pos(run: dict) -> str:
    rates = run.get("acceptance_per_pos") or []
    return ", ".join(map(str, rates)) or "-"


def _table(runs: list[dict]) -> str:
    return columns(
        runs,
        {
            "batch": "batch",
            "configuration": "config",
            "output tok/s": "output_tok_s",
            "x vs none": "vs_none",
            "TPOT ms": "tpot_ms",
            "TPOT x none": "tpot_vs_none",
            "accepted / proposed": lambda r: _or_dash(r.get("acceptance_rate")),
            "accepted per draft": lambda r: _or_dash(r.get("mean_accepted")),
            "per position": _per_pos,
            "outputs ≠": lambda r: f"{r['differing_outputs']} of {r['requests']}",
        },
    )


def _or_dash(value):
    return "-" if value is None else value
