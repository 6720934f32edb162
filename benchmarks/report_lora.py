"""The report's section for `pagestream bench lora` (benchmarks/lora.py)."""

from __future__ import annotations

from benchmarks.markdown import columns, measured

HEADING = "## LoRA adapters against the base model (CPU)"


def lora_section(part: dict) -> list[str]:
    workload = part["workload"]
    return [
        HEADING,
        "",
        _words(part),
        "",
        "### Every request in one generate call (continuous batching)",
        "",
        f"The default workload's first {workload['num_requests']} requests: "
        f"{workload['prompt_tokens']} prompt tokens (median {workload['prompt_median']}, max "
        f"{workload['prompt_max']}), {workload['output_tokens']} output tokens (median "
        f"{workload['output_median']}, max {workload['output_max']}), ignore_eos; adapters "
        "spread round-robin over the requests.",
        "",
        _table(part["runs"]),
        "",
        *_targets(part),
        "",
        "### One chat: one request at a time (batch 1)",
        "",
        f"The same workload's first {part['chat_requests']} requests one after the other, "
        f"up to {part['chat_max_tokens']} output tokens each; an adapter's rows run its "
        "rank's first adapter (on the engine of that rank's fewest adapters).",
        "",
        _chat_table(part["chat"]),
    ]


def _words(part: dict) -> str:
    adapters = part["adapters"]
    sizes = ", ".join(
        f"rank {r['rank']}: {r['count']} of {r['file_bytes'] / 1e6:.1f} MB each"
        for r in adapters["per_rank"]
    )
    return (
        measured(part, "pagestream bench lora", f"{part['threads']} threads")
        + f" Greedy, through `LLM.generate` with the model in {part['dtype']} "
        f"({part['weight_bytes'] / 1e6:.1f} MB of weights). Adapters: random PEFT LoRA "
        "adapters made by the benchmark (peft.get_peft_model, lora_alpha = r, "
        f"init_lora_weights=False, then every A and B drawn from a normal of std "
        f"{adapters['std']}, seeded) on {'/'.join(adapters['targets'])} of every layer; "
        f"{sizes}. Configurations: the base model alone (enable_lora off); LoRA on with no "
        "request using an adapter (max_loras and max_lora_rank of the largest run: what "
        "having LoRA on costs); n adapters of rank r, max_loras = max_cpu_loras = n (all in "
        f"one step) and max_lora_rank = r. Each of {part['rounds']} round(s) runs every "
        "configuration on an engine of its own (no prefix caching, every adapter loaded "
        "during its warm-up), in a rotated order; figures are medians over the rounds, "
        "ratios the median of each round's ratio to the same round's base run. TPOT: per "
        "request, first to last token over its tokens - 1, the median request. Outputs = "
        "base: requests whose greedy tokens equal the base model's all the way (LoRA on "
        "with no adapter must keep every one; an adapter changes them)."
    )


def _rank(run: dict):
    return "-" if run["rank"] is None else run["rank"]


def _table(runs: list[dict]) -> str:
    return columns(
        runs,
        {
            "configuration": "config",
            "adapters": "adapters",
            "rank": _rank,
            "output tok/s": "output_tok_s",
            "x vs base": "vs_base",
            "TPOT ms": lambda r: _or_dash(r["tpot_ms"]),
            "TPOT x base": lambda r: _or_dash(r["tpot_vs_base"]),
            "outputs = base": lambda r: f"{r['equal_outputs']} of {r['requests']}",
        },
    )


def _chat_table(runs: list[dict]) -> str:
    return columns(
        runs,
        {
            "configuration": "config",
            "rank": _rank,
            "TPOT ms": lambda r: _or_dash(r["tpot_ms"]),
            "TPOT x base": lambda r: _or_dash(r["tpot_vs_base"]),
            "output tok/s": "output_tok_s",
            "x vs base": "vs_base",
            "outputs = base": lambda r: f"{r['equal_outputs']} of {r['requests']}",
        },
    )


def _targets(part: dict) -> list[str]:
    """The issue's targets, met or missed, and what having LoRA on costs."""
    lines = []
    for target in part["targets"]:
        which = "" if target["issue_target"] else " (beyond the issue's rank 8, same bound)"
        verdict = "**met**" if target["met"] else "**missed**"
        lines.append(
            f"- Target: {target['adapters']} adapters of rank {target['rank']} cost at most "
            f"{target['max_cost']:.0%} of the base model's output tok/s{which}: "
            f"x{target['vs_base']}, a cost of {target['cost']:.1%}: {verdict}."
        )
    off = next((r for r in part["runs"] if r["enable_lora"] and not r["adapters"]), None)
    if off is not None:
        lines.append(
            f"- LoRA on with no adapter: x{off['vs_base']} the base model's output tok/s; "
            f"greedy tokens equal to the base model's for {off['equal_outputs']} of "
            f"{off['requests']} requests."
        )
    return lines


def _or_dash(value):
    return "-" if value is None else value
