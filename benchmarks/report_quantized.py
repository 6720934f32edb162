"""The report's section for `pagestream bench quantized` (benchmarks/quantized.py)."""

from __future__ import annotations

from benchmarks.markdown import columns, measured

HEADING = "## A GGUF file as it is, against llama.cpp on the same file (CPU)"


def quantized_section(part: dict) -> list[str]:
    agreement = part.get("agreement", {})
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
        columns(
            part["runs"],
            {
                "run": "name",
                "output tok/s": lambda r: r.get("output_tokens_per_s", "-"),
                "seconds": lambda r: round(r.get("elapsed_s", 0), 2),
                "equal to float32": lambda r: agreement.get(r["name"], {}).get("equal", "-"),
                "mean first difference": lambda r: agreement.get(r["name"], {}).get(
                    "mean_first_difference", "-"
                ),
            },
        ),
    ]
