"""The report's section for `pagestream bench quantized` (benchmarks/quantized.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.report_sections import markdown_table, replace_section

HEADING = "## A GGUF file as it is, against llama.cpp on the same file (CPU)"


def add_to_report(results: dict, docs_dir: Path) -> bool:
    part = (results.get("quantized") or {}).get("offline")
    path = docs_dir / "benchmarks.md"
    if not part or not path.exists():
        return False
    replace_section(path, HEADING, "\n".join(quantized_section(part)))
    return True


def quantized_section(part: dict) -> list[str]:
    meta = part.get("meta", {})
    machine = meta.get("machine", {})
    agreement = part.get("agreement", {})
    rows = []
    for run in part["runs"]:
        agreed = agreement.get(run["name"], {})
        rows.append(
            [
                run["name"],
                run.get("output_tokens_per_s", "-"),
                round(run.get("elapsed_s", 0), 2),
                agreed.get("equal", "-"),
                agreed.get("mean_first_difference", "-"),
            ]
        )
    ratios = "; ".join(f"{name}: {value}" for name, value in part.get("ratios", {}).items())
    return [
        HEADING,
        "",
        f"Reproduce: `{meta.get('command', 'pagestream bench quantized')}`; measured "
        f"{machine.get('date', '?')} on {machine.get('cpu', '?')} (torch "
        f"{machine.get('torch', '?')}). The workload's prompts and output lengths "
        f"(ignore_eos) through pagestream with {part['source_gguf']}'s blocks kept and "
        "through llama.cpp on that file (and, with $LLAMA_QUANTIZE, both on a Q8_0 file "
        "llama-quantize made from the F32 export of the same weights), one engine at a time, "
        "bfloat16 KV caches; agreement: requests whose greedy tokens equal pagestream "
        "float32's on the de-quantized weights, and the mean index of the first difference. "
        f"Throughput ratios (ours / llama.cpp): {ratios}.",
        "",
        markdown_table(
            ["run", "output tok/s", "seconds", "equal to float32", "mean first difference"],
            rows,
        ),
    ]
