"""The report's section for `pagestream bench latency` (benchmarks/latency.py)."""

from __future__ import annotations

from benchmarks.markdown import columns, measured

HEADING = "## Time per output token at small batches (CPU)"


def latency_section(part: dict) -> list[str]:
    torch = part.get("meta", {}).get("machine", {}).get("torch")
    dtypes = part["dtypes"]
    batches = list(next(iter(dtypes.values()))["pagestream"]["ms_per_token"])
    return [
        HEADING,
        "",
        measured(part, "pagestream bench latency", f"{part['threads']} threads, torch {torch}")
        + f" A {part['prompt_len']}-token prompt, then "
        f"{part['output_len']} greedy tokens; ms per output token = (time for all - time for "
        f"one) / {part['output_len'] - 1}, median of {part['rounds']} rounds. The streaming "
        "limit is the bytes a decode step reads (every linear weight and the LM head) over "
        "the highest read bandwidth measured in the run (summing 1 GiB, before and after "
        f"each dtype: {', '.join(map(str, part['read_gb_s']))} GB/s; the machine is shared "
        "and drifts). llama.cpp: batch 1 on F32 / BF16 GGUF files of the same weights, same "
        "threads and prompt.",
        "",
        columns(
            [{"dtype": dtype, **entry} for dtype, entry in dtypes.items()],
            {
                "dtype": "dtype",
                **{f"batch {b} ms/token": f"pagestream.ms_per_token.{b}" for b in batches},
                "streaming limit ms": "streaming_limit_ms",
                "batch 1 / limit": "batch1_over_limit",
                "llama.cpp batch 1 ms/token": lambda e: e.get("llamacpp", {}).get(
                    "ms_per_token", "-"
                ),
                "llama.cpp / ours": lambda e: e.get("llamacpp_over_ours", "-"),
            },
        ),
    ]
