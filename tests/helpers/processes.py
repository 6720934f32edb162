"""Helpers for tests that run pagestream roles as local processes: free ports, health
waits, process trees, stopping (nothing leaks), greedy calls over gRPC and HTTP, and a
compose file's services turned into local commands (service names -> 127.0.0.1, ports
remapped to free ones, the environment rewritten the same way)."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from tests.helpers.eventually import eventually

TIMEOUT_S = 60
START_TIMEOUT_S = 180
POLL_S = 0.1  # between polls of a process's health (each one a request to it)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli(*args: str) -> list[str]:
    """The argv of `pagestream ARGS...` run with this interpreter."""
    return [sys.executable, "-m", "pagestream.cli", *args]


# ---- health --------------------------------------------------------------------------
def health_status(address: str, timeout_s: float = 2.0) -> int | None:
    """grpc.health.v1 status of the server at address, or None when it does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            return (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
                .status
            )
        except grpc.RpcError:
            return None


def wait_serving(
    address: str, processes: Iterable[subprocess.Popen], timeout_s: float = START_TIMEOUT_S
) -> None:
    """Until address reports SERVING; fails at once when one of processes has exited."""
    processes = list(processes)

    def serving() -> bool:
        for process in processes:
            assert process.poll() is None, f"{process.args} exited with {process.returncode}"
        return health_status(address, timeout_s=1.0) == SERVING

    eventually(serving, f"{address} SERVING", timeout=timeout_s, interval=0.2)


def http_status(port: int | str, path: str, timeout_s: float = 5.0) -> int | None:
    """The HTTP status of GET path on 127.0.0.1:port, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


# ---- process trees -------------------------------------------------------------------
def children(pid: int) -> list[int]:
    """The direct children of pid (from /proc/PID/task/*/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task or the process ended meanwhile
            continue
    return sorted(set(found))


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += children(child)
    return sorted(out)


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """True while pid runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone(pids: Iterable[int]) -> bool:
    """True once none of pids runs (a condition for eventually())."""
    return not any(alive(pid) for pid in pids)


def worker_ranks(pid: int) -> dict[int, int]:
    """rank -> pid of the `pagestream worker` processes below pid (mp or --split-services)."""
    ranks = {}
    for child in descendants(pid):
        argv = cmdline(child)
        if "pagestream.cli" in argv and "worker" in argv and "--rank" in argv:
            ranks[int(argv[argv.index("--rank") + 1])] = child
    return ranks


def kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def serving(argv: list[str], grpc_port: int, http_port: int):
    """A `pagestream serve ...` process, yielded once gRPC serves and /ready is 200; then
    SIGTERM (SIGKILL after 30 s) and whatever it left behind killed."""
    process = subprocess.Popen(argv)
    try:
        wait_serving(f"127.0.0.1:{grpc_port}", [process], START_TIMEOUT_S)
        eventually(
            lambda: http_status(http_port, "/ready") == 200,
            "/ready 200",
            timeout=START_TIMEOUT_S,
            interval=POLL_S,
        )
        yield process
    finally:
        pids = descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        kill_pids(pids)


def stop(processes: Iterable[subprocess.Popen], timeout_s: float = TIMEOUT_S) -> list[int]:
    """SIGTERM each process in turn, last started first (as compose stops its services),
    SIGKILL one that outlives timeout_s; the exit codes in the given order."""
    processes = list(processes)
    codes = {}
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            codes[process.pid] = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            codes[process.pid] = process.wait()
    return [codes[process.pid] for process in processes]


# ---- greedy calls --------------------------------------------------------------------
def grpc_token_ids(address: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy token ids from the public gRPC Generate stream (ignore_eos)."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(token_ids=prompt_ids),
        sampling_params=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        responses = list(stub.Generate(request, timeout=TIMEOUT_S))
    assert responses[-1].usage.completion_tokens == max_tokens
    return [t for r in responses for t in r.token_ids]


def http_completion_text(port: str | int, prompt, max_tokens: int) -> str:
    """Greedy text of /v1/completions (ignore_eos), over plain urllib."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    http = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(http, timeout=TIMEOUT_S) as reply:
        return json.load(reply)["choices"][0]["text"]


# ---- compose files as local processes --------------------------------------------------
@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # the file's environment, rewritten
    depends_on: list[str] = field(default_factory=list)

    @property
    def health_address(self) -> str:
        return f"127.0.0.1:{self.env['HEALTH_PORT']}"


@dataclass
class LocalCompose:
    services: dict[str, LocalService]
    ports: dict[str, str]  # the file's port -> the free local port that replaces it

    def stages(self) -> list[list[LocalService]]:
        """Services in start order: each stage depends only on earlier ones (one stage
        holds every rank of a worker group, which must start together)."""
        done: set[str] = set()
        stages = []
        while len(done) < len(self.services):
            stage = [
                s
                for name, s in self.services.items()
                if name not in done and set(s.depends_on) <= done
            ]
            assert stage, f"circular depends_on among {set(self.services) - done}"
            stages.append(stage)
            done |= {s.name for s in stage}
        return stages


def _localize(text: str, hosts: Iterable[str], ports: dict[str, str]) -> str:
    for host in sorted(hosts, key=len, reverse=True):
        text = text.replace(f"{host}:", "127.0.0.1:")
    for old, new in ports.items():
        text = text.replace(old, new)
    return text.replace("0.0.0.0", "127.0.0.1")


def local_compose(
    path: Path,
    model: Path,
    ports: Iterable[str],
    extra_args: Callable[[str], list[str]] = lambda name: [],
) -> LocalCompose:
    """The services of the compose file at path as local commands: service names become
    127.0.0.1 (in commands as HOST:PORT, in the environment as whole values), each of ports
    a free local port (commands and environment), the model is appended, then
    extra_args(service name)."""
    spec = yaml.safe_load(path.read_text())["services"]
    port_map = {port: str(free_port()) for port in ports}
    services = {}
    for name, service in spec.items():
        argv = shlex.split(_localize(service["command"], spec, port_map))
        assert argv[0] == "pagestream", argv
        env = {
            key: "127.0.0.1" if str(value) in spec else _localize(str(value), spec, port_map)
            for key, value in (service.get("environment") or {}).items()
        }
        services[name] = LocalService(
            name,
            [*cli(*argv[1:]), str(model), *extra_args(name)],
            env,
            list(service.get("depends_on") or []),
        )
    return LocalCompose(services, port_map)


def start_compose(compose: LocalCompose, processes: list[subprocess.Popen]) -> None:
    """Start every service stage by stage (a stage once the previous one is SERVING on
    its HEALTH_PORT); started processes are appended to processes (the caller stops them)."""
    for stage in compose.stages():
        for service in stage:
            processes.append(subprocess.Popen(service.argv, env={**os.environ, **service.env}))
        for service in stage:
            wait_serving(service.health_address, processes)
