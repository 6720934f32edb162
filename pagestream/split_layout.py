"""`serve --split-services` and `serve -dp N`: every role as a supervised child process.

SplitLayout fixes where the roles listen (ports kept across restarts, so peers find a
restarted role again); split_roles turns it and the serve flags into the children's
commands (per replica its worker ranks, one restart group, and its scheduler; then one
routing frontend); run_split hands them to the Supervisor.
"""

from __future__ import annotations

import argparse
import random
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass

from pagestream.cli_flags import FRONTEND_CONFIGS, FRONTEND_ENGINE_FLAGS, RankConfig, role_argv
from pagestream.roles import engine_args, router_config, tool_options
from services.common.flags import from_flags, to_flags
from services.common.supervisor import Child, Supervisor
from services.common.tls import TlsConfig


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: a role binds its port only after
    it has started (a scheduler after its workers loaded), and a port from the ephemeral
    range can meanwhile be taken as the source port of any outgoing connection (the
    workers' gloo group, a gRPC client), which no restart frees."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(min(20000, low - 1000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # every candidate was taken: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; IANA's 49152 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return max(2048, int(handle.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 49152


@dataclass(frozen=True)
class SplitLayout:
    """Where the split roles listen (fixed across restarts, so peers find them again):
    per data-parallel replica, its worker ranks' ports and its scheduler's port."""

    worker_ports: list[list[int]]
    scheduler_ports: list[int]
    folder: str  # rendezvous files of the worker groups, one per replica and generation

    @classmethod
    def create(cls, world_size: int, data_parallel_size: int = 1) -> SplitLayout:
        folder = tempfile.mkdtemp(prefix="pagestream-split-")
        replicas = range(data_parallel_size)
        workers = [[_free_port() for _ in range(world_size)] for _ in replicas]
        return cls(workers, [_free_port() for _ in replicas], folder)

    def rendezvous(self, replica: int, generation: int) -> str:
        return f"file://{self.folder}/rendezvous-{replica}-{generation}"


def split_roles(ns: argparse.Namespace, layout: SplitLayout) -> list[Child]:
    """Per replica: its worker rank(s) (one restart group) and its scheduler; then one
    frontend that routes over every scheduler."""
    roles: list[Child] = []
    for replica in range(len(layout.scheduler_ports)):
        roles += _replica_roles(ns, layout, replica)
    frontend = _command("frontend", ns, frontend_flags(ns, layout.scheduler_ports))
    return [*roles, Child.of_argv("frontend", frontend)]


def frontend_flags(ns: argparse.Namespace, scheduler_ports: list[int]) -> list[str]:
    """The frontend child's flags: its schedulers, then serve's frontend configs as given."""
    flags = [a for p in scheduler_ports for a in ("--scheduler", f"127.0.0.1:{p}")]
    flags += to_flags(engine_args(ns), FRONTEND_ENGINE_FLAGS)
    for config in (*FRONTEND_CONFIGS, TlsConfig):
        flags += to_flags(from_flags(config, ns))
    return flags


def _command(role: str, ns: argparse.Namespace, *configs) -> list[str]:
    return [sys.executable, *role_argv(role, ns.model, *configs, log_level=ns.log_level)]


def _replica_roles(ns: argparse.Namespace, layout: SplitLayout, replica: int) -> list[Child]:
    args, tls = engine_args(ns), from_flags(TlsConfig, ns)
    world_size = args.parallel_config().world_size
    ports = layout.worker_ports[replica]
    suffix = f" of replica {replica}" if len(layout.scheduler_ports) > 1 else ""

    def worker(rank: int, port: int):
        # One machine: replica r's ranks take CUDA devices r * world_size + rank (as vLLM's
        # data-parallel ranks do), so the replicas never share a GPU.
        local_rank = replica * world_size + rank

        def command(generation: int) -> list[str]:
            place = RankConfig(local_rank=local_rank)
            if world_size > 1:
                rendezvous = layout.rendezvous(replica, generation)
                place = RankConfig(rank, local_rank, rendezvous)
            return _command("worker", ns, ["--port", str(port)], place, tls, args)

        return Child(f"worker rank {rank}{suffix}", command, group=f"workers-{replica}")

    addresses = [a for p in ports for a in ("--worker", f"127.0.0.1:{p}")]
    where = ["--port", str(layout.scheduler_ports[replica])]
    scheduler = _command("scheduler", ns, addresses, where, tls, args)
    return [
        *(worker(rank, port) for rank, port in enumerate(ports)),
        Child.of_argv(f"scheduler{suffix}", scheduler),
    ]


def run_split(ns: argparse.Namespace) -> int:
    """Start the roles as supervised child processes: a child that dies is restarted
    (with backoff and a give-up limit); SIGTERM / SIGINT stop them all. With
    --data-parallel-size N: N worker groups with a scheduler each, one routing frontend."""
    dp = getattr(ns, "data_parallel_size", 1)
    if dp < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {dp}.")
    router_config(ns)  # a bad --router-* flag fails now, not in the frontend child
    tool_options(ns)  # a bad --chat-template or tool flag fails now, not in the frontend child
    world_size = engine_args(ns).parallel_config().world_size
    layout = SplitLayout.create(world_size, dp)
    try:
        return Supervisor(split_roles(ns, layout), max_restarts=ns.max_restarts).run()
    finally:
        shutil.rmtree(layout.folder, ignore_errors=True)
