"""Soak: mixed traffic against the split deployment for a fixed time, then the books.

    python -m benchmarks.soak --model MODEL --duration 600 [--clients 8] [--json out.json]

A worker, a scheduler (small KV cache: preemption) and a frontend as processes, and
`--clients` threads sending requests of random KINDS until the time is up. A request that
does not end with its final message (or, for bad input, its refusal) within its timeout is
lost; afterwards the engine must hold no request or KV block, and memory must stay flat."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from benchmarks.load_clients import free_port, grpc_serving, proc_stat, wait_ready
from pagestream.supervisor import terminate
from services.common.proto.pagestream.v1 import engine_pb2, engine_pb2_grpc, generation_pb2_grpc
from services.common.proto.pagestream.v1 import generation_pb2 as pb

REQUEST_TIMEOUT_S = 300.0
TIMED_OUT = "timed out"
KINDS = ("stream", "http_stream", "cancel", "n", "beam", "prefix", "bad")
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
        leaked = self.engine_after.get("kv_cache_usage", 1.0) > 0 or any(
            self.engine_after.get(k, 1) for k in ("num_running_reqs", "num_waiting_reqs")
        )
        return not self.lost and not leaked


def _grpc(stub, request: pb.GenerateRequest, cancel_after: int = 0, bad: bool = False):
    """None when the request ended as it should (a bad one: refused), else what went wrong."""
    call = stub.Generate(request, timeout=REQUEST_TIMEOUT_S)
    finished, seen = False, 0
    try:
        for response in call:
            seen += 1
            finished = finished or bool(response.usage.completion_tokens)
            if cancel_after and seen >= cancel_after:
                call.cancel()
                return None
    except grpc.RpcError as exc:
        code = exc.code()
        if bad:
            return (
                None
                if code == grpc.StatusCode.INVALID_ARGUMENT
                else f"bad input answered {code.name}"
            )
        if cancel_after and code == grpc.StatusCode.CANCELLED:
            return None
        return (
            TIMED_OUT
            if code == grpc.StatusCode.DEADLINE_EXCEEDED
            else f"gRPC {code.name}: {exc.details()}"
        )
    if bad:
        return "bad input was served"
    return None if finished else "the stream ended without a final message"


def _http_stream(port: int, prompt: list[int], max_tokens: int) -> str | None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            lines = [line.strip() for line in reply if line.strip()]
    except (urllib.error.URLError, OSError) as exc:
        return f"HTTP: {exc}"
    return None if lines and lines[-1] == b"data: [DONE]" else "SSE without [DONE]"


class Traffic:
    """One client's random requests (seeded): prompts of random ids, some sharing prefixes."""

    def __init__(self, http_port: int, seed: int) -> None:
        self.http_port, self.rng = http_port, random.Random(seed)
        shared = [self.rng.randrange(3, 400) for _ in range(48)]
        self.prefixes = [shared[:16], shared[:32], shared]

    def one(self, stub, kind: str) -> str | None:
        rng, tokens = self.rng, self.rng.randrange(1, 48)
        head = rng.choice(self.prefixes) if kind == "prefix" else []
        prompt = head + [rng.randrange(3, 400) for _ in range(rng.randrange(1, 40))]
        if kind == "http_stream":
            return _http_stream(self.http_port, prompt, tokens)
        if kind == "bad":
            params = pb.SamplingParams(temperature=-3.0)
            return _grpc(stub, pb.GenerateRequest(text="x", sampling_params=params), bad=True)
        params = {
            "stream": {"max_tokens": tokens, "ignore_eos": True},
            "cancel": {"max_tokens": 200, "ignore_eos": True},
            "n": {"n": rng.randrange(2, 5), "temperature": 0.8, "seed": rng.randrange(99)},
            "beam": {"n": rng.randrange(2, 4), "use_beam_search": True, "max_tokens": tokens},
            "prefix": {"max_tokens": tokens},
        }[kind]
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(token_ids=prompt),
            sampling_params=pb.SamplingParams(**{"temperature": 0.0, **params}),
        )
        return _grpc(stub, request, cancel_after=rng.randrange(1, 4) if kind == "cancel" else 0)


def drive(grpc_address: str, http_port: int, duration_s: float, clients: int, seed: int = 0):
    """Run the traffic; (request counts per kind, lost requests)."""
    counts, lost, lock = Counter(), [], threading.Lock()
    deadline = time.monotonic() + duration_s

    def client(traffic: Traffic) -> None:
        with grpc.insecure_channel(grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while time.monotonic() < deadline:
                kind = traffic.rng.choice(KINDS)
                try:
                    problem = traffic.one(stub, kind)
                except Exception as exc:  # anything unexpected is a lost request too
                    problem = f"{type(exc).__name__}: {exc}"
                with lock:
                    counts[kind] += 1
                    if problem == TIMED_OUT:
                        counts["timed_out"] += 1
                    elif problem is not None:
                        lost.append(f"{kind}: {problem}")

    threads = [
        threading.Thread(target=client, args=(Traffic(http_port, seed + i),))
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=duration_s + REQUEST_TIMEOUT_S + 30)
        if thread.is_alive():
            lost.append("a client thread never finished (a request hangs)")
    return dict(counts), lost


class RssSampler(threading.Thread):
    """Each role's resident memory (MiB), sampled every `interval_s`."""

    def __init__(self, pids: dict[str, int], interval_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval_s = pids, interval_s
        self.samples: dict[str, list[float]] = {role: [] for role in pids}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            for role, pid in self.pids.items():
                fields = proc_stat(pid)  # rss: field 24, in pages
                rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20 if fields else 0.0
                self.samples[role].append(rss)

    def summary(self) -> tuple[dict[str, list[float]], dict[str, float]]:
        """[median of the first quarter, median of the last quarter] and their ratio."""
        ends, growth = {}, {}
        for role, values in self.samples.items():
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
    ports = {role: free_port() for role in ("worker", "scheduler", "grpc", "http")}
    worker, scheduler = (f"127.0.0.1:{ports[role]}" for role in ("worker", "scheduler"))
    frontend = f"127.0.0.1:{ports['grpc']}"
    commands = {
        "worker": ["worker", model, "--port", str(ports["worker"]), *engine_flags],
        "scheduler": [
            "scheduler",
            model,
            "--worker",
            worker,
            "--port",
            str(ports["scheduler"]),
            *engine_flags,
        ],
        "frontend": [
            "frontend",
            model,
            "--scheduler",
            scheduler,
            "--grpc-port",
            str(ports["grpc"]),
            "--port",
            str(ports["http"]),
        ],
    }
    cli = [sys.executable, "-m", "pagestream.cli", "--log-level", "WARNING"]
    processes = {role: subprocess.Popen(cli + argv) for role, argv in commands.items()}
    try:
        wait_ready(processes.values(), lambda: grpc_serving(frontend), 300.0, "the deployment")
        sampler = RssSampler({role: p.pid for role, p in processes.items()})
        sampler.start()
        start = time.monotonic()
        counts, lost = drive(frontend, ports["http"], duration_s, clients)
        timed_out = counts.pop("timed_out", 0)
        report = SoakReport(round(time.monotonic() - start, 1), counts, lost, timed_out)
        report.engine_after = wait_idle(scheduler)
        sampler.stopping.set()
        report.rss_mib, report.rss_growth = sampler.summary()
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
    parser.add_argument(
        "--kv-cache-memory",
        default="24MiB",
        help="small, to force preemption (24MiB: ~32 blocks of 16 tokens of the default model)",
    )
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
