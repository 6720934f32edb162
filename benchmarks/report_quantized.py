"""The report's section for `pagestream bench quantized` (benchmarks/quantized.py)."""

from __future__ import annotations

from benchmarks.markdown import measured, table

HEADING = "## A GGUF file as it is, against llama.cpp on the same file (CPU)"


def quantized_section(part: dict) -> list[str]:
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
        measured(part, "pagestream bench quantized") + " The workload's prompts and output lengths "
        f"(ignore_eos) through pagestream with {part['source_gguf']}'s blocks kept and "
        "through llama.cpp on that file (and, with $LLAMA_QUANTIZE, both on a Q8_0 file "
        "llama-quantize made from the F32 export of the same weights), one engine at a time, "
        "bfloat16 KV caches; agreement: requests whose greedy tokens equal pagestream "
        "float32's on the de-quantized weights, and the mean index of the first difference. "
        f"Throughput ratios (ours / llama.cpp): {ratios}.",
        "",
        table(
            ["run", "output tok/s", "seconds", "equal to float32", "mean first difference"],
            rows,
        ),
    ]
