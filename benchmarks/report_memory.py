"""The report's "Memory" section (benchmarks/memory.py): KV-cache utilisation, prefix
caching and memory sharing."""

from __future__ import annotations

from benchmarks.markdown import table


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
                    [
                        f"paged (blocks of {kv['block_size']})",
                        kv["paged"],
                        round(1 - kv["paged"], 4),
                    ],
                    [
                        "preallocate max_model_len",
                        kv["prealloc_max"],
                        round(1 - kv["prealloc_max"], 4),
                    ],
                    [
                        "preallocate exact length (oracle)",
                        kv["prealloc_oracle"],
                        round(1 - kv["prealloc_oracle"], 4),
                    ],
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
        table(
            ["prefix cache", "total tok/s", "TTFT mean ms", "TTFT p50 ms", "cached tokens"],
            [
                [
                    name,
                    prefix[name]["total_tokens_per_s"],
                    prefix[name]["ttft_mean_ms"],
                    prefix[name]["ttft_p50_ms"],
                    prefix[name]["cached_tokens"],
                ]
                for name in ("off", "on")
            ],
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
                [
                    "independent requests (each prompt x width)",
                    share["independent"]["peak_blocks"],
                    "—",
                ],
                [
                    f"parallel sampling n={share['width']}",
                    share["parallel_sampling"]["peak_blocks"],
                    share["parallel_sampling"]["saving_vs_independent"],
                ],
                [
                    f"beam search width {share['width']}",
                    share["beam_search"]["peak_blocks"],
                    share["beam_search"]["saving_vs_independent"],
                ],
            ],
        ),
        "",
        "![memory](benchmarks/memory.png)",
        "",
    ]
    return out
