"""The report's section for `pagestream bench precision` (benchmarks/precision.py)."""

from __future__ import annotations

from benchmarks.markdown import measured, table

HEADING = "## bfloat16 against float32 on the CPU"


def precision_section(part: dict) -> list[str]:
    a = part["agreement"]
    tok_s = part["output_tok_s"]
    return [
        HEADING,
        "",
        measured(part, "pagestream bench precision") + " The profile's workload "
        f"({part['requests']} requests, greedy, ignore_eos) through `LLM.generate` in each "
        f"dtype, the dtypes in a rotated order each of {part['rounds']} rounds; medians. bf16 "
        "is mixed precision (bf16 weights and matmuls; float32 residual stream, norms and "
        "LM-head rescoring). The machine is shared: compare within this section.",
        "",
        table(
            ["dtype", "output tok/s (median)", "per round"],
            [[d, tok_s[d], ", ".join(map(str, part["output_tok_s_per_round"][d]))] for d in tok_s],
        ),
        "",
        f"- bf16 / float32 output tok/s: **x{part['bf16_over_fp32']}**.",
        f"- Greedy agreement with float32: {a['equal']} of {a['requests']} requests equal all "
        f"the way; the first difference falls at token {a['mean_first_difference']} on "
        f"average (mean output length {a['mean_output_len']}).",
    ]
