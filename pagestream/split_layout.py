"""`serve --split-services` and `serve -dp N`: every role as a supervised child process.

SplitLayout fixes where the roles listen (ports kept across restarts, so peers find a
restarted role again); split_roles turns it and the serve flags into the children's
commands (per replica its worker ranks, one restart group, and its scheduler; then one
routing frontend); run_split hands them to the Supervisor.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass

from pagestream.roles import engine_args, router_config, tls_flags, tool_options
from pagestream.supervisor import Role, Supervisor


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def split_roles(ns: argparse.Namespace, layout: SplitLayout) -> list[Role]:
    """Per replica: its worker rank(s) (one restart group) and its scheduler; then one
    frontend that routes over every scheduler."""
    roles: list[Role] = []
    for replica in range(len(layout.scheduler_ports)):
        roles += _replica_roles(ns, layout, replica)
    base = [sys.executable, "-m", "pagestream.cli", "--log-level", ns.log_level]
    frontend = [*base, "frontend", ns.model, *_frontend_flags(ns, layout.scheduler_ports)]
    frontend += tls_flags(ns)
    return [*roles, Role("frontend", lambda _: frontend)]


def _replica_roles(ns: argparse.Namespace, layout: SplitLayout, replica: int) -> list[Role]:
    args = engine_args(ns)
    world_size = args.parallel_config().world_size
    base = [sys.executable, "-m", "pagestream.cli", "--log-level", ns.log_level]
    flags, tls = args.to_cli_flags(), tls_flags(ns)
    ports = layout.worker_ports[replica]
    suffix = f" of replica {replica}" if len(layout.scheduler_ports) > 1 else ""

    def worker(rank: int, port: int):
        # One machine: replica r's ranks take CUDA devices r * world_size + rank (as vLLM's
        # data-parallel ranks do), so the replicas never share a GPU.
        device = ["--local-rank", str(replica * world_size + rank)]

        def command(generation: int) -> list[str]:
            group = []
            if world_size > 1:
                rendezvous = layout.rendezvous(replica, generation)
                group = ["--rank", str(rank), "--dist-init-method", rendezvous]
            return [*base, "worker", ns.model, "--port", str(port), *group, *device, *tls, *flags]

        return Role(f"worker rank {rank}{suffix}", command, group=f"workers-{replica}")

    addresses = [a for p in ports for a in ("--worker", f"127.0.0.1:{p}")]
    port = str(layout.scheduler_ports[replica])
    scheduler = [*base, "scheduler", ns.model, *addresses, "--port", port, *tls, *flags]
    return [
        *(worker(rank, port) for rank, port in enumerate(ports)),
        Role(f"scheduler{suffix}", lambda _: scheduler),
    ]


def _frontend_flags(ns: argparse.Namespace, scheduler_ports: list[int]) -> list[str]:
    flags = [a for p in scheduler_ports for a in ("--scheduler", f"127.0.0.1:{p}")]
    flags += ["--host", ns.host]
    flags += ["--grpc-port", str(ns.grpc_port), "--port", str(ns.port)]
    if ns.api_key:
        flags += ["--api-key", ns.api_key]
    if ns.served_model_name:
        flags += ["--served-model-name", ns.served_model_name]
    for name, flag in (*FRONTEND_LIMIT_FLAGS, *ROUTER_FLAGS, *TOOL_FLAGS):
        if getattr(ns, name, None) is not None:
            flags += [flag, str(getattr(ns, name))]
    if getattr(ns, "enable_auto_tool_choice", False):
        flags.append("--enable-auto-tool-choice")
    return [*flags, "--generation-config", ns.generation_config]


# The frontend's protections, passed on to the frontend child of --split-services.
FRONTEND_LIMIT_FLAGS = (
    ("max_prompt_bytes", "--max-prompt-bytes"),
    ("max_messages", "--max-messages"),
    ("max_n", "--max-n"),
    ("max_request_body_bytes", "--max-request-body-bytes"),
    ("request_timeout_s", "--request-timeout"),
    ("max_unread_tokens", "--max-unread-tokens"),
)


# Tool calling and the chat template, passed on to the frontend child (tool_choice.py).
TOOL_FLAGS = (
    ("tool_call_parser", "--tool-call-parser"),
    ("chat_template", "--chat-template"),
)


# The router's settings, passed on to the frontend child (services/frontend/router.py).
ROUTER_FLAGS = (
    ("router_policy", "--router-policy"),
    ("router_cache_threshold", "--router-cache-threshold"),
    ("router_balance_abs_threshold", "--router-balance-abs-threshold"),
    ("router_balance_rel_threshold", "--router-balance-rel-threshold"),
)


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
