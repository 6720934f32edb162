"""The service roles the CLI starts: worker, scheduler, frontend, and serve (all of them)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import fields

from pagestream.engine_args import EngineArgs
from services.common.grpc_server import serve_forever

logger = logging.getLogger("pagestream")

GRACE_S = 10.0


class ServerGroup:
    """A gRPC server plus an optional HTTP server, stopped together (HTTP first)."""

    def __init__(self, grpc_server, http_server=None, on_stop=None) -> None:
        self.grpc_server = grpc_server
        self.http_server = http_server
        self.on_stop = on_stop

    async def stop(self, grace: float | None = GRACE_S) -> None:
        if self.http_server is not None:
            await self.http_server.stop()
        await self.grpc_server.stop(grace)
        if self.on_stop is not None:
            await self.on_stop()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    args = EngineArgs.from_cli_args(ns)
    args.model = ns.model
    return args


async def start_http(frontend, ns: argparse.Namespace, model_name: str):
    """The OpenAI-compatible HTTP server on --host/--port (a negative port turns it off)."""
    if ns.port is None or ns.port < 0:
        return None
    from services.frontend.openai.app import build_app
    from services.frontend.openai.http_server import serve_http

    names = [ns.served_model_name or model_name]
    app = build_app(frontend, names, api_key=ns.api_key or os.environ.get("PAGESTREAM_API_KEY"))
    return await serve_http(app, ns.host, ns.port)


async def run_worker(ns: argparse.Namespace) -> None:
    from services.worker.worker_service import serve_worker

    args = engine_args(ns)
    server = await serve_worker(args.model_config(), args.cache_config(), ns.host, ns.port)
    logger.info("worker serving on %s", server.address)
    await serve_forever(server, GRACE_S)


async def run_scheduler(ns: argparse.Namespace) -> None:
    from services.scheduler.engine_core_service import serve_scheduler

    server = await serve_scheduler(ns.worker, engine_args(ns), ns.host, ns.port)
    logger.info("scheduler serving on %s (worker %s)", server.address, ns.worker)
    await serve_forever(server, GRACE_S)


async def run_frontend(ns: argparse.Namespace) -> None:
    from services.frontend.frontend_server import connect_frontend, serve_frontend
    from services.frontend.generation_defaults import load_generation_defaults
    from services.frontend.tokenizer import load_tokenizer
    from services.worker.default_model import resolve_model

    folder = await asyncio.to_thread(resolve_model, ns.model)
    tokenizer = await asyncio.to_thread(load_tokenizer, folder)
    defaults = load_generation_defaults(folder, ns.generation_config)
    ready = asyncio.ensure_future(connect_frontend(ns.scheduler, tokenizer, defaults))
    grpc_server = await serve_frontend(ready, ns.host, ns.grpc_port)
    frontend = await ready  # raises (and exits non-zero) when the scheduler never comes up
    http = await start_http(frontend, ns, frontend.info.model)
    logger.info("frontend: gRPC on %s, scheduler %s", grpc_server.address, ns.scheduler)
    await serve_forever(ServerGroup(grpc_server, http, frontend.close), GRACE_S)


async def run_serve(ns: argparse.Namespace) -> None:
    """Every role in this process: the engine in-process behind gRPC and HTTP."""
    from pagestream.async_engine import AsyncEngine
    from services.frontend.frontend_server import serve_frontend

    engine = await asyncio.to_thread(AsyncEngine.from_engine_args, engine_args(ns))
    grpc_server = await serve_frontend(engine.frontend, ns.host, ns.grpc_port)
    http = await start_http(engine.frontend, ns, engine.info.model)
    where = f"gRPC {grpc_server.address}" + (f", HTTP {http.url}" if http else "")
    logger.info("pagestream serving %s on %s", ns.model, where)
    await serve_forever(ServerGroup(grpc_server, http, engine.shutdown), GRACE_S)


# ---- --split-services: three processes over loopback gRPC --------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _engine_flags(args: EngineArgs) -> list[str]:
    """EngineArgs back to CLI flags (only the ones that differ from the defaults)."""
    defaults = EngineArgs()
    flags: list[str] = []
    for f in fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name == "model" or value == getattr(defaults, f.name) or value is None:
            continue
        name = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + f.name.replace("_", "-"))
        else:
            flags += [name, str(value)]
    return flags


def split_commands(ns: argparse.Namespace) -> list[list[str]]:
    worker_port, scheduler_port = _free_port(), _free_port()
    base = [sys.executable, "-m", "pagestream.cli", "--log-level", ns.log_level]
    flags = _engine_flags(engine_args(ns))
    frontend = ["--scheduler", f"127.0.0.1:{scheduler_port}", "--host", ns.host]
    frontend += ["--grpc-port", str(ns.grpc_port), "--port", str(ns.port)]
    if ns.api_key:
        frontend += ["--api-key", ns.api_key]
    if ns.served_model_name:
        frontend += ["--served-model-name", ns.served_model_name]
    frontend += ["--generation-config", ns.generation_config]
    return [
        [*base, "worker", ns.model, "--port", str(worker_port), *flags],
        [
            *base,
            "scheduler",
            ns.model,
            "--worker",
            f"127.0.0.1:{worker_port}",
            "--port",
            str(scheduler_port),
            *flags,
        ],
        [*base, "frontend", ns.model, *frontend],
    ]


def run_split(ns: argparse.Namespace) -> int:
    """Start the three roles as child processes; stop them all when one ends or on a signal."""
    children = [subprocess.Popen(cmd) for cmd in split_commands(ns)]
    stopping = False

    def stop(*_):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while all(child.poll() is None for child in children):
            with contextlib.suppress(subprocess.TimeoutExpired):
                children[0].wait(timeout=0.5)
    finally:
        stop()
        codes = [_wait_or_kill(child, GRACE_S + 5) for child in children]
    logger.info("roles exited with %s", codes)
    return max(abs(code) for code in codes)


def _wait_or_kill(child: subprocess.Popen, timeout_s: float) -> int:
    try:
        return child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()
