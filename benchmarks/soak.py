"""Soak: mixed traffic against the split deployment for a fixed time, then the books.

    python -m benchmarks.soak --model MODEL --duration 600 [--clients 8] [--json out.json]

Starts a worker, a scheduler (small KV cache, so preemption happens) and a frontend as
processes, and runs `--clients` threads of random requests until the time is up: gRPC and
HTTP streams, streams cancelled mid-way, n > 1, beam search, prompts sharing prefixes, and
bad inputs (which must be refused with 400 / INVALID_ARGUMENT). Every request must end
with a final message (or the refusal it deserves): a stream that ends any other way, or
not within its timeout, is a lost request. At the end the engine must hold no request and
no KV block, and each role's resident memory (sampled every second) must stay flat.
"""

from __future__ import annotations

import argparse
import functools
import json
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
from grpc_health.v1 import health_pb2_grpc

from benchmarks.server_process import free_port, grpc_serving, stop_process, wait_ready
from services.common.proto.pagestream.v1 import engine_pb2, engine_pb2_grpc, generation_pb2_grpc
from services.common.proto.pagestream.v1 import generation_pb2 as pb

REQUEST_TIMEOUT_S = 300.0
TIMED_OUT = "timed out"
KINDS = ("stream", "http_stream", "cancel", "n", "beam", "prefix", "bad")


@dataclass
class SoakReport:
    duration_s: float
    requests: dict[str, int] = field(default_factory=dict)  # kind -> count
    lost: list[str] = field(default_factory=list)  # what went wrong, per lost request
    # Requests the client gave up on at its deadline (REQUEST_TIMEOUT_S): they did end (the
    # server aborts them and frees their blocks), but say the machine was too slow.
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


# ---- one request of each kind -----------------------------------------------------------
def _params(**kwargs) -> pb.SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return pb.SamplingParams(**kwargs)


def _grpc_stream(stub, prompt: list[int], params: pb.SamplingParams, cancel_after: int = 0):
    """None when the request ended as it should, else what went wrong."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(token_ids=prompt), sampling_params=params)
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
        if cancel_after and exc.code() == grpc.StatusCode.CANCELLED:
            return None
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TIMED_OUT
        return f"gRPC {exc.code().name}: {exc.details()}"
    return None if finished else "the stream ended without a final message"


def _grpc_bad(stub) -> str | None:
    request = pb.GenerateRequest(text="x", sampling_params=_params(temperature=-3.0))
    try:
        list(stub.Generate(request, timeout=REQUEST_TIMEOUT_S))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return None
        return f"bad input answered {exc.code().name}"
    return "bad input was served"


def _http_stream(port: int, prompt: list[int], max_tokens: int) -> str | None:
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            lines = [line.strip() for line in reply if line.strip()]
    except (urllib.error.URLError, OSError) as exc:
        return f"HTTP: {exc}"
    return None if lines and lines[-1] == b"data: [DONE]" else "SSE without [DONE]"


class Traffic:
    def __init__(self, grpc_address: str, http_port: int, seed: int) -> None:
        self.grpc_address = grpc_address
        self.http_port = http_port
        self.rng = random.Random(seed)
        shared = [self.rng.randrange(3, 400) for _ in range(48)]
        self.prefixes = [shared[:16], shared[:32], shared]

    def _prompt(self, shared: bool = False) -> list[int]:
        head = self.rng.choice(self.prefixes) if shared else []
        return head + [self.rng.randrange(3, 400) for _ in range(self.rng.randrange(1, 40))]

    def one(self, stub, kind: str) -> str | None:
        rng, tokens = self.rng, self.rng.randrange(1, 48)
        if kind == "stream":
            return _grpc_stream(stub, self._prompt(), _params(max_tokens=tokens, ignore_eos=True))
        if kind == "http_stream":
            return _http_stream(self.http_port, self._prompt(), tokens)
        if kind == "cancel":
            params = _params(max_tokens=200, ignore_eos=True)
            return _grpc_stream(stub, self._prompt(), params, cancel_after=rng.randrange(1, 4))
        if kind == "n":
            params = _params(n=rng.randrange(2, 5), temperature=0.8, seed=rng.randrange(99))
            return _grpc_stream(stub, self._prompt(), params)
        if kind == "beam":
            params = _params(n=rng.randrange(2, 4), use_beam_search=True, max_tokens=tokens)
            return _grpc_stream(stub, self._prompt(), params)
        if kind == "prefix":
            return _grpc_stream(stub, self._prompt(shared=True), _params(max_tokens=tokens))
        return _grpc_bad(stub)


def _client(traffic: Traffic, deadline: float, counts: Counter, lost: list, lock) -> None:
    with grpc.insecure_channel(traffic.grpc_address) as channel:
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


def drive(grpc_address: str, http_port: int, duration_s: float, clients: int, seed: int = 0):
    """Run the traffic; (request counts per kind, lost requests)."""
    counts, lost, lock = Counter(), [], threading.Lock()
    deadline = time.monotonic() + duration_s
    threads = [
        threading.Thread(
            target=_client,
            args=(Traffic(grpc_address, http_port, seed + i), deadline, counts, lost, lock),
        )
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=duration_s + REQUEST_TIMEOUT_S + 30)
        if thread.is_alive():
            lost.append("a client thread never finished (a request hangs)")
    return dict(counts), lost


# ---- the deployment ---------------------------------------------------------------------
def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class RssSampler(threading.Thread):
    def __init__(self, pids: dict[str, int], interval_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval_s = pids, interval_s
        self.samples: dict[str, list[float]] = {role: [] for role in pids}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            for role, pid in self.pids.items():
                self.samples[role].append(_rss_mib(pid))

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


def engine_stats(scheduler_address: str) -> dict[str, float]:
    with grpc.insecure_channel(scheduler_address) as channel:
        stats = engine_pb2_grpc.EngineCoreStub(channel).GetStats(
            engine_pb2.GetStatsRequest(), timeout=10
        )
    return {
        "num_running_reqs": stats.num_running_reqs,
        "num_waiting_reqs": stats.num_waiting_reqs,
        "kv_cache_usage": stats.kv_cache_usage,
        "num_preemptions": stats.num_preemptions,
    }


def wait_idle(scheduler_address: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The engine's stats once it holds nothing (or the last seen after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(scheduler_address)
        idle = not stats["num_running_reqs"] and not stats["num_waiting_reqs"]
        if (idle and stats["kv_cache_usage"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagestream.cli", "--log-level", "WARNING", *args]


def soak(model: str, duration_s: float, clients: int, engine_flags: list[str]) -> SoakReport:
    ports = {role: free_port() for role in ("worker", "scheduler", "grpc", "http")}
    scheduler = f"127.0.0.1:{ports['scheduler']}"
    commands = {
        "worker": _cli("worker", model, "--port", str(ports["worker"]), *engine_flags),
        "scheduler": _cli(
            "scheduler", model, "--worker", f"127.0.0.1:{ports['worker']}",
            "--port", str(ports["scheduler"]), *engine_flags,
        ),
        "frontend": _cli(
            "frontend", model, "--scheduler", scheduler,
            "--grpc-port", str(ports["grpc"]), "--port", str(ports["http"]),
        ),
    }  # fmt: skip
    processes = {role: subprocess.Popen(argv) for role, argv in commands.items()}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
            health = functools.partial(grpc_serving, health_pb2_grpc.HealthStub(channel))
            wait_ready(processes.values(), health, 300.0, "the deployment")
        sampler = RssSampler({role: p.pid for role, p in processes.items()})
        sampler.start()
        start = time.monotonic()
        counts, lost = drive(f"127.0.0.1:{ports['grpc']}", ports["http"], duration_s, clients)
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
            stop_process(process, 20)


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
