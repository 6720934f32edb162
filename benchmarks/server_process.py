"""`pagestream serve` as a child process for the serving benchmark: start, wait until it is
healthy on both transports, stop with SIGTERM (the way a user or an orchestrator stops it)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    model: str
    split_services: bool = False
    engine_flags: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    env: dict[str, str] | None = None  # set in the server's environment (and its children's)

    def __post_init__(self) -> None:
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "pagestream.cli", "--log-level", "WARNING", "serve"]
        command += [self.model, "--grpc-port", str(self.grpc_port), "--port", str(self.http_port)]
        command += list(self.engine_flags)
        if self.split_services:
            command.append("--split-services")
        return command

    def __enter__(self) -> ServerProcess:
        env = {**os.environ, **self.env} if self.env else None
        self.process = subprocess.Popen(self.command(), env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        """Poll /ready (HTTP readiness) and grpc.health.v1 until both answer SERVING."""
        ready = {"http": False, "grpc": False}
        with grpc.insecure_channel(self.grpc_address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def healthy() -> bool:
                ready["http"] = ready["http"] or http_healthy(f"{self.http_url}/ready")
                ready["grpc"] = ready["grpc"] or grpc_serving(health)
                return all(ready.values())

            what = f"the server `{' '.join(self.command())}`"
            wait_ready([self.process], healthy, self.startup_timeout_s, what)

    def stop(self, timeout_s: float = 30.0) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        children = descendants(process.pid)  # the roles of --split-services / -dp
        stop_process(process, timeout_s)
        _kill_leftovers(children)


def wait_ready(processes, ready, timeout_s: float, what: str) -> None:
    """Poll ``ready()`` until it holds; raise when one of ``processes`` exits first or
    ``timeout_s`` passes (polling external processes: nothing to await)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"{what} exited before it was ready")
        if ready():
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what} was not ready within {timeout_s} s")


def stop_process(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM (the way a user or an orchestrator stops it), SIGKILL after ``timeout_s``."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("process %d ignored SIGTERM for %.0f s; killing it", process.pid, timeout_s)
        process.kill()
        process.wait()


def descendants(pid: int) -> list[int]:
    """The process ids below ``pid`` (Linux /proc; empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo += parents.get(child, [])
    return found


def _kill_leftovers(pids: list[int]) -> None:
    """SIGKILL the children a stopped server left behind (its supervisor stops them)."""
    for pid in pids:
        if not _running(pid):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            logger.warning("killed process %d, left behind by the server", pid)
        except (ProcessLookupError, PermissionError):
            pass


def _running(pid: int) -> bool:
    """True while pid runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def http_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def grpc_serving(stub) -> bool:
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
