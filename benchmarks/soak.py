"""Soak: mixed traffic against the split deployment for a fixed time, then the books.

    python -m benchmarks.soak --model MODEL --duration 600 [--clients 8] [--json out.json]

A worker, a scheduler (small KV cache: preemption) and a frontend as processes, and
`--clients` clients (benchmarks/load_clients.py's) sending requests of random KINDS until the
time is up. A request that does not end with its final message (bad input: its refusal) in
its timeout is lost; afterwards the engine must hold nothing, and memory must stay flat."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from benchmarks.load_clients import (
    GrpcClient,
    HttpClient,
    free_port,
    grpc_serving,
    proc_stat,
    wait_ready,
)
from benchmarks.workload import BenchRequest
from services.common.proto.pagestream.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common.supervisor import terminate

REQUEST_TIMEOUT_S = 300.0
TIMED_OUT = "timed out"
KINDS = ("stream", "http_stream", "cancel", "n", "beam", "prefix", "bad")
PAGE = os.sysconf("SC_PAGE_SIZE")
STATS = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "num_preemptions")


@dataclass
class SoakReport:
    duration_s: float
    requests: dict[str, int] = field(default_factory=dict)  # kind -> count
    lost: list[str] = field(default_factory=list)  # what went wrong, per lost request
    # Requests the client gave up on at REQUEST_TIMEOUT_S: they did end (the server aborts
    # them and frees their blocks), but say the machine was too slow.
    timed_out: int = 0
    engine_after: dict[str, float] = field(default_factory=dict)
    rss_mib: dict[str, list[float]] = field(default_factory=dict)  # role -> [first, last]
    rss_growth: dict[str, float] = field(default_factory=dict)  # role -> last/first

    @property
    def ok(self) -> bool:
        held = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage")  # leaked, at the end
        return not self.lost and not any(self.engine_after.get(k, 1) for k in held)


async def _one(clients: dict, rng: random.Random, prefixes: list, kind: str) -> str | None:
    """Sends a request of this kind: None when it ended as it should, else what went wrong."""
    head = rng.choice(prefixes) if kind == "prefix" else []
    prompt = head + [rng.randrange(3, 400) for _ in range(rng.randrange(1, 40))]
    request = BenchRequest(prompt, 200 if kind == "cancel" else rng.randrange(1, 48))
    params = {
        "cancel": {"cancel_after": rng.randrange(1, 4)},
        "n": {"n": rng.randrange(2, 5), "temperature": 0.8, "seed": rng.randrange(99)},
        "beam": {"n": rng.randrange(2, 4), "use_beam_search": True},
        "bad": {"temperature": -3.0},
    }.get(kind, {})
    if kind in ("n", "beam", "prefix"):
        params["ignore_eos"] = False
    record = await clients["http" if kind == "http_stream" else "grpc"].send(request, **params)
    error = record.error or ""
    if kind == "bad":
        refused = error.startswith("INVALID_ARGUMENT")
        return None if refused else f"bad input answered {error or 'with tokens'}"
    if error:
        return TIMED_OUT if error.startswith("DEADLINE_EXCEEDED") else error
    if kind == "cancel" or record.output_tokens:
        return None
    return "the stream ended without a final message"


async def drive(address: str, url: str, duration_s: float, clients: int, pids: dict[str, int]):
    """Run the traffic; (request counts per kind, lost requests, RSS samples per role)."""
    counts, lost = Counter(), []
    rss: dict[str, list[float]] = {role: [] for role in pids}
    deadline = time.monotonic() + duration_s

    async def client(senders: dict, rng: random.Random) -> None:
        shared = [rng.randrange(3, 400) for _ in range(48)]
        prefixes = [shared[:16], shared[:32], shared]
        while time.monotonic() < deadline:
            kind = rng.choice(KINDS)
            try:
                problem = await _one(senders, rng, prefixes, kind)
            except Exception as exc:  # anything unexpected is a lost request too
                problem = f"{type(exc).__name__}: {exc}"
            counts[kind] += 1
            if problem == TIMED_OUT:
                counts["timed_out"] += 1
            elif problem is not None:
                lost.append(f"{kind}: {problem}")

    async def sample() -> None:  # every role's resident memory (MiB), every second
        while time.monotonic() < deadline:
            for role, pid in pids.items():
                fields = proc_stat(pid)  # rss: field 24, in pages
                rss[role].append(int(fields[21]) * PAGE / 2**20 if fields else 0.0)
            await asyncio.sleep(1.0)

    async with (
        GrpcClient(address, REQUEST_TIMEOUT_S) as grpc_client,
        HttpClient(url, timeout_s=REQUEST_TIMEOUT_S) as http_client,
    ):
        senders = {"grpc": grpc_client, "http": http_client}
        loads = [client(senders, random.Random(i)) for i in range(clients)]
        loads = asyncio.gather(sample(), *loads)
        try:
            await asyncio.wait_for(loads, duration_s + REQUEST_TIMEOUT_S + 30)
        except TimeoutError:
            lost.append("a client never finished (a request hangs)")
    return dict(counts), lost, rss


def rss_summary(samples: dict[str, list[float]]) -> tuple[dict, dict]:
    """Per role: [median of the first quarter, median of the last quarter], and their ratio."""
    ends, growth = {}, {}
    for role, values in samples.items():
        quarter = max(1, len(values) // 4)
        first = sorted(values[:quarter])[quarter // 2] if values else 0.0
        last = sorted(values[-quarter:])[quarter // 2] if values else 0.0
        ends[role] = [round(first, 1), round(last, 1)]
        growth[role] = round(last / first, 3) if first else 0.0
    return ends, growth


def wait_idle(scheduler_address: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The engine's stats once it holds nothing (or the last seen after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(scheduler_address) as channel:
        stub = engine_pb2_grpc.EngineCoreStub(channel)
        while True:
            stats = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=10)
            busy = stats.num_running_reqs or stats.num_waiting_reqs or stats.kv_cache_usage
            if not busy or time.monotonic() > deadline:
                return {name: getattr(stats, name) for name in STATS}
            time.sleep(0.2)


def soak(model: str, duration_s: float, clients: int, engine_flags: list[str]) -> SoakReport:
    port = {role: str(free_port()) for role in ("worker", "scheduler", "grpc", "http")}
    local = {role: f"127.0.0.1:{number}" for role, number in port.items()}
    commands = {
        "worker": ["worker", model, "--port", port["worker"], *engine_flags],
        "scheduler": ["scheduler", model, "--worker", local["worker"], "--port", port["scheduler"]],
        "frontend": ["frontend", model, "--scheduler", local["scheduler"], "--port", port["http"]],
    }
    commands["scheduler"] += engine_flags
    commands["frontend"] += ["--grpc-port", port["grpc"]]
    cli = [sys.executable, "-m", "pagestream.cli", "--log-level", "WARNING"]
    processes = {role: subprocess.Popen(cli + argv) for role, argv in commands.items()}
    try:
        ready = functools.partial(grpc_serving, local["grpc"])
        wait_ready(processes.values(), ready, 300.0, "the deployment")
        pids = {role: p.pid for role, p in processes.items()}
        start = time.monotonic()
        url = f"http://{local['http']}"
        counts, lost, rss = asyncio.run(drive(local["grpc"], url, duration_s, clients, pids))
        timed_out = counts.pop("timed_out", 0)
        report = SoakReport(round(time.monotonic() - start, 1), counts, lost, timed_out)
        report.engine_after = wait_idle(local["scheduler"])
        report.rss_mib, report.rss_growth = rss_summary(rss)
        for role, process in processes.items():
            if process.poll() is not None:
                report.lost.append(f"the {role} exited with {process.returncode}")
        return report
    finally:
        for process in reversed(processes.values()):
            terminate([process], 20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="24MiB", help="small: it forces preemption")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    flags = ["--kv-cache-memory", args.kv_cache_memory, "--swap-space", "0.01"]
    report = soak(args.model, args.duration, args.clients, flags)
    text = json.dumps({**asdict(report), "ok": report.ok}, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
