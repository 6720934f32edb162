"""The report's section for `pagestream bench precision` (benchmarks/precision.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report_sections import markdown_table, replace_section

HEADING = "## bfloat16 against float32 on the CPU"


def add_to_report(results: dict, docs_dir: Path) -> bool:
    part = (results.get("precision") or {}).get("offline")
    path = docs_dir / "benchmarks.md"
    if not part or not path.exists():
        return False
    replace_section(path, HEADING, "\n".join(precision_section(part)))
    return True


def precision_section(part: dict) -> list[str]:
    meta, a = part.get("meta", {}), part["agreement"]
    machine = meta.get("machine", {})
    tok_s = part["output_tok_s"]
    return [
        HEADING,
        "",
        f"Reproduce: `{meta.get('command', 'pagestream bench precision')}`; measured "
        f"{machine.get('date', '?')} on {machine.get('cpu', '?')} ({machine.get('cores', '?')} "
        f"cores, torch {machine.get('torch', '?')}). The profile's workload "
        f"({part['requests']} requests, greedy, ignore_eos) through `LLM.generate` in each "
        f"dtype, the dtypes in a rotated order each of {part['rounds']} rounds; medians. bf16 "
        "is mixed precision (bf16 weights and matmuls; float32 residual stream, norms and "
        "LM-head rescoring). The machine is shared: compare within this section.",
        "",
        markdown_table(
            ["dtype", "output tok/s (median)", "per round"],
            [[d, tok_s[d], ", ".join(map(str, part["output_tok_s_per_round"][d]))] for d in tok_s],
        ),
        "",
        f"- bf16 / float32 output tok/s: **x{part['bf16_over_fp32']}**.",
        f"- Greedy agreement with float32: {a['equal']} of {a['requests']} requests equal all "
        f"the way; the first difference falls at token {a['mean_first_difference']} on "
        f"average (mean output length {a['mean_output_len']}).",
    ]
