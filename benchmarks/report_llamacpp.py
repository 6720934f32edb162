"""The throughput section's llama.cpp part (`pagestream bench throughput --llamacpp`,
benchmarks/llamacpp.py): pagestream against llama.cpp in the same dtype, and the greedy
agreement that shows both run the same model."""

from __future__ import annotations

PAIRS = (("F32", "float32"), ("BF16", "bfloat16"))


def markdown_table(header: list[str], rows: list[list]) -> str:
    """As report_sections' (which imports benchmarks.report, which imports this module)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("—" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def llamacpp_lines(tp: dict) -> list[str]:
    info = tp.get("llamacpp")
    if not info:
        return []
    by_name = {r["name"]: r for r in tp["runs"]}
    rows = []
    for ggml, torch_dtype in PAIRS:
        ratio = tp["ratios"].get(f"vs_llamacpp_{ggml.lower()}")
        for name in info["runs"]:
            if name.startswith(f"llama.cpp {ggml} "):
                best = ratio is not None and ratio["baseline"] == name
                rows.append(_row(by_name[name], ratio if best else None, torch_dtype))
    first = by_name[info["runs"][0]] if info["runs"] else {}
    kv = "one unified buffer" if info["kv_unified"] else "a stream per sequence"
    out = [
        "### llama.cpp on the same workload",
        "",
        f"llama.cpp through llama-cpp-python {info['llama_cpp_python']} (built from source "
        "with `-DGGML_NATIVE=ON`), its own continuous batching: up to n_seq_max sequences "
        f"per context, each `llama_decode` {info['n_batch']} tokens at most (one per "
        "decoding sequence, then prompt chunks), a finished sequence's KV cells freed for "
        f"the next request; {first.get('n_threads', '?')} threads as pagestream; KV cache in "
        f"the run's dtype, {kv}; flash attention {info.get('flash_attn', 'auto')}. "
        f"Weights: F32 / BF16 GGUF files written from `{info['source_gguf']}` (the weights "
        "pagestream dequantizes; BF16 matrices, F32 norms). Same prompts, output lengths, "
        "greedy, no early stop.",
        "",
        markdown_table(
            [
                "engine",
                "output tok/s",
                "seconds",
                "llama_decode calls",
                "load avg",
                "pagestream / it",
            ],
            rows,
        ),
        "",
    ]
    for ggml, _ in PAIRS:
        a = info.get("agreement", {}).get(ggml)
        if a:
            out.append(
                f"- Greedy agreement, llama.cpp {ggml} vs pagestream float32 on the first "
                f"{a['requests']} prompts x {a['tokens_each']} tokens: {a['equal']} of "
                f"{a['requests']} equal all the way (first differences at "
                f"{', '.join(map(str, a['first_differences']))})."
            )
    return [*out, *_full_agreement_lines(info.get("agreement_full") or {}), ""]


def _full_agreement_lines(full: dict) -> list[str]:
    """Greedy agreement with pagestream float32 over the whole workload, a line per run."""
    lines = []
    for a in full.values():
        lines.append(
            f"- Whole workload ({a['requests']} requests, mean output length "
            f"{a['mean_output_len']}), {a['run']} vs pagestream float32: {a['equal']} of "
            f"{a['requests']} equal all the way; the first difference falls at token "
            f"{a['mean_first_difference']} on average."
        )
    return lines


def _row(run: dict, ratio: dict | None, torch_dtype: str) -> list:
    speedup = None
    if ratio is not None:
        speedup = f"x{ratio['output_tokens_per_s']} ({torch_dtype})"
    return [
        run["name"],
        run["output_tokens_per_s"],
        run["elapsed_s"],
        run.get("num_steps"),
        "{start}..{end}".format(**run["load_average"]) if "load_average" in run else None,
        speedup,
    ]
