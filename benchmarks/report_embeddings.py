"""The report's sections for `pagestream bench embed` (benchmarks/embeddings.py): the
decoder mode's against HF AutoModel, the encoder mode's (--encoders)."""

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


ENCODER_HEADING = "## Encoders against sentence-transformers and llama-server (CPU)"
ENCODER_COLUMNS = {
    "configuration": "config",
    "weights": "dtype",
    "inputs/s": "inputs_per_s",
    "x vs sentence-transformers": "vs_st",
    "x vs llama-server": "vs_llama",
    "tokens/s": "tokens_per_s",
    "one input ms": "single_ms",
    "cosine min": "cosine_min",
    "cosine median": "cosine_median",
}


def encoder_section(part: dict) -> list[str]:
    command = "pagestream bench embed --encoders minilm,bge-base"
    out = [
        ENCODER_HEADING,
        "",
        measured(part, command, f"{part['threads']} threads")
        + " Random-weight BERT encoders of real shapes, the same passages as text for every "
        'engine: `LLM(folder, runner="pooling", dtype=D).embed(texts)` in one call (float32, '
        "and dtype auto: bfloat16 where the CPU has native bf16); "
        "sentence-transformers' `encode(texts, batch_size=B)`; llama-server `--embedding -np "
        "C` on the GGUF file its own converter made, C clients posting one text each to "
        f"/v1/embeddings. Medians over {part['rounds']} round(s) in rotated orders; `x vs` is "
        "the median of each round's ratio to its fastest sentence-transformers B / "
        f"llama-server C. One input: the first {part['single_inputs']} one at a time, median "
        "ms. Cosine: against sentence-transformers' embeddings.",
    ]
    for shape in part["shapes"]:
        inputs, llama = shape["inputs"], shape["llama_server"]
        server = f"absent ({llama['error']})" if "error" in llama else llama["version"]
        out += [
            "",
            f"### {shape['shape']}: {shape['layers']} layers, hidden {shape['hidden']}, "
            f"{shape['pooling']} pooling + Normalize",
            "",
            f"{inputs['count']} inputs ({inputs['tokens']} tokens, median {inputs['median']:.0f}, "
            f"max {inputs['max']}); llama-server: {server}.",
            "",
            columns(shape["runs"], ENCODER_COLUMNS),
        ]
    return out
