"""The report's "Memory" section (benchmarks/memory.py): KV-cache utilisation, prefix
caching and memory sharing."""

from __future__ import annotations

from benchmarks.markdown import columns, table


def memory_section(mem: dict) -> list[str]:
    kv, prefix, share = mem["kv_utilization"], mem["prefix_caching"], mem["sharing"]
    out = ["## Memory", "", "### KV-cache utilisation", ""]
    if kv.get("num_samples"):
        out += [
            f"Sampled after each of {kv['num_samples']} steps of the offline run: the share of "
            "allocated KV slots holding real tokens, against a system that reserves each live "
            f"request's maximum length up front (max_model_len {kv['max_model_len']}), or its "
            "exact final length (an oracle).",
            "",
            table(
                ["allocation", "mean utilisation", "waste"],
                [
                    [label, kv[key], round(1 - kv[key], 4)]
                    for label, key in (
                        (f"paged (blocks of {kv['block_size']})", "paged"),
                        ("preallocate max_model_len", "prealloc_max"),
                        ("preallocate exact length (oracle)", "prealloc_oracle"),
                    )
                ],
            ),
            "",
            "![KV utilisation](benchmarks/kv_utilization.png)",
            "",
        ]
    out += [
        "### Prefix caching",
        "",
        f"{prefix['num_requests']} requests sharing a {prefix['system_prompt_len']}-token system "
        f"prompt, each with its own {prefix['question_len']}-token question and "
        f"{prefix['output_len']} output tokens, admitted at once.",
        "",
        columns(
            [{"name": name, **prefix[name]} for name in ("off", "on")],
            {
                "prefix cache": "name",
                "total tok/s": "total_tokens_per_s",
                "TTFT mean ms": "ttft_mean_ms",
                "TTFT p50 ms": "ttft_p50_ms",
                "cached tokens": "cached_tokens",
            },
        ),
        "",
        f"Throughput {prefix['speedup']}x with caching; mean TTFT x{prefix['ttft_ratio']}.",
        "",
        "### Memory sharing",
        "",
        f"{share['num_prompts']} prompts ({share['prompt_tokens']} tokens), width "
        f"{share['width']}, {share['output_len']} output tokens per sequence; prefix caching off.",
        "",
        table(
            ["run", "peak KV blocks", "saving vs independent"],
            [
                [label, share[key]["peak_blocks"], share[key].get("saving_vs_independent", "—")]
                for label, key in (
                    ("independent requests (each prompt x width)", "independent"),
                    (f"parallel sampling n={share['width']}", "parallel_sampling"),
                    (f"beam search width {share['width']}", "beam_search"),
                )
            ],
        ),
        "",
        "![memory](benchmarks/memory.png)",
        "",
    ]
    return out
