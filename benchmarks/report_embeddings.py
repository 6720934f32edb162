"""The report's section for `pagestream bench embed` (benchmarks/embeddings.py)."""

from __future__ import annotations

from benchmarks.markdown import columns, measured

HEADING = "## Embeddings against HF AutoModel (CPU)"


def embed_section(part: dict) -> list[str]:
    inputs = part["inputs"]
    return [
        HEADING,
        "",
        measured(part, "pagestream bench embed", f"{part['threads']} threads")
        + f" {inputs['count']} inputs of the default corpus ({inputs['tokens']} tokens, "
        f"median {inputs['median']:.0f}, max {inputs['max']}), the same token ids for every "
        f"configuration; {part['pooling_type']} pooling, L2-normalized. pagestream: "
        '`LLM(runner="pooling").embed(inputs)` in one call; HF: `AutoModel` float32 in '
        "padded batches in input order. Each of "
        f"{part['rounds']} round(s) runs every configuration in a rotated order; figures are "
        "medians over the rounds, `x vs HF` the median of each round's ratio to that round's "
        f"fastest HF batch size. One input: the first {part['single_inputs']} inputs one at "
        "a time, the median ms per input. Cosine: against HF float32's embeddings (lowest, "
        "median).",
        "",
        columns(
            part["runs"],
            {
                "configuration": "config",
                "weights": lambda r: (
                    r["quantization"] if r["quantization"] != "none" else r["dtype"]
                ),
                "inputs/s": "inputs_per_s",
                "x vs HF": "vs_hf",
                "tokens/s": "tokens_per_s",
                "one input ms": lambda r: "-" if r["single_ms"] is None else r["single_ms"],
                "cosine min": "cosine_min",
                "cosine median": "cosine_median",
            },
        ),
    ]
