"""The report's "Headline" and "Offline throughput" sections (benchmarks/throughput.py):
every engine on the same requests, the ratios, the matmul ceiling, and llama.cpp
(`--llamacpp`, benchmarks/llamacpp.py) in the same dtype with the greedy agreement that shows
both run the same model."""

from __future__ import annotations

from benchmarks.markdown import columns, table

PAIRS = (("F32", "float32"), ("BF16", "bfloat16"))


def llamacpp_lines(tp: dict) -> list[str]:
    info = tp.get("llamacpp")
    if not info:
        return []
    by_name = {r["name"]: r for r in tp["runs"]}
    rows = []
    for ggml, torch_dtype in PAIRS:
        ratio = tp["ratios"].get(f"vs_llamacpp_{ggml.lower()}") or {}
        for name in info["runs"]:
            if name.startswith(f"llama.cpp {ggml} "):
                best = ratio.get("baseline") == name
                speedup = f"x{ratio['output_tokens_per_s']} ({torch_dtype})" if best else None
                rows.append({**by_name[name], "speedup": speedup})
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
        columns(
            rows,
            {
                "engine": "name",
                "output tok/s": "output_tokens_per_s",
                "seconds": "elapsed_s",
                "llama_decode calls": "num_steps",
                "load avg": lambda r: (
                    "{start}..{end}".format(**r["load_average"]) if "load_average" in r else None
                ),
                "pagestream / it": "speedup",
            },
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


def headline(tp: dict) -> str:
    """The README's table: pagestream in float32 and bfloat16 against HF transformers and
    llama.cpp on the same workload, with each run's fraction of its dtype's matmul ceiling."""
    runs = {r["name"]: r for r in tp["runs"]}
    fractions = {
        **tp.get("ceiling", {}).get("fraction", {}),
        **tp.get("ceiling_bfloat16", {}).get("fraction", {}),
    }
    ours = {_dtype_of(n): r for n, r in runs.items() if n.startswith("pagestream")}
    shown = [n for n in runs if n.startswith("pagestream")]
    for key in ("vs_hf_static_best", "vs_hf_continuous", "vs_llamacpp_f32", "vs_llamacpp_bf16"):
        if key in tp["ratios"]:
            shown.append(tp["ratios"][key]["baseline"])
    rows = []
    for name in shown:
        run, mine = runs[name], ours.get(_dtype_of(name))
        speed = run["output_tokens_per_s"]
        ratio = (
            "1.00x"
            if name.startswith("pagestream") or mine is None
            else (f"{mine['output_tokens_per_s'] / speed:.2f}x faster")
        )
        fraction = fractions.get(name)
        rows.append([name, speed, ratio, None if fraction is None else f"{fraction:.0%}"])
    return table(
        [
            "engine (offline, same prompts and lengths)",
            "output tok/s",
            "pagestream, same dtype",
            "of the matmul ceiling",
        ],
        rows,
    )


def _dtype_of(name: str) -> str:
    return "bfloat16" if "bfloat16" in name or "BF16" in name else "float32"


def throughput_section(tp: dict) -> list[str]:
    runs = columns(
        tp["runs"],
        {
            "engine": "name",
            "requests/s": "requests_per_s",
            "output tok/s": "output_tokens_per_s",
            "total tok/s": "total_tokens_per_s",
            "seconds": "elapsed_s",
            "tokens generated": "generated_tokens",
        },
    )
    out = ["## Offline throughput", "", runs, ""]
    for key, ratio in tp["ratios"].items():
        out.append(
            f"- {ratio.get('ours', 'pagestream')} / {ratio['baseline']}: "
            f"{ratio['requests_per_s']}x requests/s, "
            f"{ratio['output_tokens_per_s']}x output tok/s, {ratio['total_tokens_per_s']}x "
            f"total tok/s ({key})"
        )
    out += ["", *llamacpp_lines(tp)]
    for key in ("ceiling", "ceiling_bfloat16"):
        if key in tp:
            out += _ceiling_lines(tp[key])
    out += [
        "![offline throughput](benchmarks/throughput.png)",
        "",
    ]
    return out


def _ceiling_lines(ceiling: dict) -> list[str]:
    return [
        f"Matmul ceiling at the model's shapes ({ceiling['num_tokens']} tokens, "
        f"{ceiling['dtype']}, {ceiling['threads']} threads, the faster of F.linear and a "
        f"prepacked oneDNN linear): **{ceiling['gflops']} GFLOP/s** (per shape: "
        + ", ".join(f"{s['shape']} {s['gflops']}" for s in ceiling["per_shape"])
        + f"). The workload needs {ceiling['workload_gflop']['total']} GFLOP "
        f"({ceiling['workload_gflop']['linear']} in linear layers, "
        f"{ceiling['workload_gflop']['attention']} in attention), so the FLOP-bound time is "
        f"{ceiling['flop_bound_s']} s. Fraction of that bound each {ceiling['dtype']} run "
        "reached:",
        "",
        table(["engine", "fraction of FLOP-bound"], list(ceiling["fraction"].items())),
        "",
    ]
