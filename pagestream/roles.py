"""The service roles the CLI starts: worker, scheduler, frontend, and serve (all of them in
one command; `--split-services` / `-dp` is pagestream/split_layout.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
import time
from dataclasses import replace
from functools import partial

from pagestream.engine_args import EngineArgs
from services.common.flags import from_flags
from services.common.grpc_server import serve_forever

logger = logging.getLogger("pagestream")

GRACE_S = 10.0
OWN_WORKER_REBUILDS = 3  # attempts to start a lost worker group of its own again


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
    return from_flags(EngineArgs, ns, model=ns.model)


async def start_http(frontend, ns: argparse.Namespace, model_name: str, tools):
    """The OpenAI-compatible HTTP server on --host/--port (a negative port turns it off);
    `tools`: tool_options(ns), read before the engine starts (a bad --chat-template fails
    then, not after the model has loaded)."""
    if ns.port is None or ns.port < 0:
        return None
    from services.frontend.lora_options import LoRAServerOptions
    from services.frontend.openai.app import build_app
    from services.frontend.openai.http_server import serve_http

    names = [ns.served_model_name or model_name]
    app = build_app(
        frontend,
        names,
        api_key=_api_key(ns),
        tool_options=tools,
        lora=from_flags(LoRAServerOptions, ns),
    )
    return await serve_http(app, ns.host, ns.port)


def load_lora_modules(frontend, ns: argparse.Namespace) -> None:
    """--lora-modules: each adapter checked and served by its name (a bad one stops the
    start, naming the problem)."""
    from services.frontend.lora_options import LoRAServerOptions

    for module in from_flags(LoRAServerOptions, ns).modules():
        try:
            frontend.input_processor.loras.load(module.name, module.path, module.base_model_name)
        except ValueError as exc:
            raise SystemExit(f"--lora-modules {module.name}={module.path}: {exc}") from exc
        logger.info("serving LoRA adapter %s (%s)", module.name, module.path)


def tool_options(ns: argparse.Namespace):
    """--enable-auto-tool-choice, --tool-call-parser, --chat-template (a file is read now)."""
    from services.frontend.chat_templates import load_chat_template
    from services.frontend.tool_options import ToolServerOptions

    options = from_flags(ToolServerOptions, ns)
    if options.chat_template is None:
        return options
    return replace(options, chat_template=load_chat_template(options.chat_template))


def tls_config(ns: argparse.Namespace):
    """--tls-cert / --tls-key / --tls-ca (None when the role has none of them)."""
    from services.common.tls import TlsConfig

    tls = from_flags(TlsConfig, ns)
    return tls if tls.enabled else None


def worker_group_rank(ns: argparse.Namespace, args: EngineArgs):
    """This worker's rank and rendezvous: flags first, then torchrun's environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Raises ValueError naming
    the flag or variable that disagrees."""
    from services.common.rank_info import RankInfo
    from services.worker.worker_service import WorkerGroupRank

    env = os.environ
    parallel = args.parallel_config()
    world_size = env.get("WORLD_SIZE")
    if world_size is not None and int(world_size) != parallel.world_size:
        raise ValueError(
            f"WORLD_SIZE={world_size} in the environment, but --tensor-parallel-size "
            f"{parallel.tensor_parallel_size} x --pipeline-parallel-size "
            f"{parallel.pipeline_parallel_size} = {parallel.world_size}."
        )
    rank = ns.rank if ns.rank is not None else int(env.get("RANK", "0"))
    local_rank = ns.local_rank if ns.local_rank is not None else env.get("LOCAL_RANK")
    init_method = ns.dist_init_method
    if init_method is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        init_method = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    if parallel.world_size > 1 and init_method is None:
        raise ValueError(
            "a worker of a group needs a rendezvous: --dist-init-method tcp://HOST:PORT "
            "(or file:///PATH), or MASTER_ADDR and MASTER_PORT in the environment."
        )
    info = RankInfo(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    local = None if local_rank is None else int(local_rank)
    return WorkerGroupRank(info, init_method, ns.dist_timeout, local)


def exit_with_parent() -> None:
    """An mp worker (PAGESTREAM_PARENT_PID set) exits as soon as its engine is gone."""
    from services.scheduler.launchers.launcher import PARENT_PID_ENV

    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        logger.error("the engine (pid %s) is gone: this worker exits", parent)
        os._exit(1)

    threading.Thread(target=watch, name="pagestream-parent-watch", daemon=True).start()


async def run_worker(ns: argparse.Namespace) -> None:
    from services.common.cpu_cores import confine_to
    from services.worker.worker_service import load_worker, start_worker_server

    confine_to(ns.cpu_cores)  # before any thread starts: they inherit the mask
    exit_with_parent()
    args = engine_args(ns)
    group = worker_group_rank(ns, args)
    server = await start_worker_server(ns.host, ns.port, tls_config(ns))
    if ns.ready_file:  # the mp launcher waits for the bound address
        tmp = f"{ns.ready_file}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(server.address)
        os.replace(tmp, ns.ready_file)
    try:
        await load_worker(server, args.model_config(), args.cache_config(), group)
    except BaseException:
        await server.stop(0)
        raise
    logger.info("worker rank %d serving on %s", group.rank.rank, server.address)
    await serve_forever(server, GRACE_S)


async def run_scheduler(ns: argparse.Namespace) -> None:
    """The EngineCore service over the workers at --worker, or, without --worker, over
    workers it starts itself (--distributed-executor-backend: uni, mp or ray): one
    data-parallel replica as one command. A --host of unix:PATH listens on a unix socket
    (how `serve` and AsyncEngine run it as their engine-core process).

    Either way a lost worker group is rebuilt in place (its own: started again, up to
    OWN_WORKER_REBUILDS attempts; at --worker: waited for). Should the engine loop die
    (those attempts failed, or a bug), the role stops and exits with code 1, so whoever
    started it (serve's engine-core watcher, compose, Kubernetes) starts it again."""
    from pagestream.executor_factory import WORKER_START_TIMEOUT_S, build_executor
    from services.scheduler.engine_core_builder import EngineCoreBuilder
    from services.scheduler.engine_core_service import serve_built_engine_core, serve_scheduler

    exit_with_parent()
    args, tls = engine_args(ns), tls_config(ns)
    if ns.worker:
        server = await serve_scheduler(ns.worker, args, ns.host, ns.port, tls=tls)
        workers = ", ".join(ns.worker)
    else:
        # A lost group of its own is started again a few times; a failure that repeats
        # (a rank that cannot load) ends the role, so its starter's give-up rule applies.
        backend = args.parallel_config().backend
        rebuilds = 0 if backend == "uni" else OWN_WORKER_REBUILDS
        make = partial(build_executor, args)
        builder = EngineCoreBuilder(args, make, WORKER_START_TIMEOUT_S)
        server = await serve_built_engine_core(
            builder, ns.host, ns.port, tls=tls, max_rebuilds=rebuilds
        )
        workers = f"its own ({backend})"
    logger.info("scheduler serving on %s (workers %s)", server.address, workers)
    core = server.servicer.core
    watch = asyncio.ensure_future(_stop_when_dead(core, server))
    try:
        await serve_forever(server, GRACE_S)
    finally:
        watch.cancel()
    if core.dead_error is not None:
        raise SystemExit(1)


async def _stop_when_dead(engine_core, server, poll_s: float = 0.5) -> None:
    """Stop the server once the engine loop has died (after its clients heard why)."""
    while engine_core.dead_error is None:
        await asyncio.sleep(poll_s)
    logger.error("the engine loop died (%s): stopping, to be restarted", engine_core.dead_error)
    await server.stop(2.0)


def router_config(ns: argparse.Namespace):
    """--router-* flags (services/frontend/router.py); ValueError names a bad one."""
    from services.frontend.router import RouterConfig

    return from_flags(RouterConfig, ns)


def _api_key(ns: argparse.Namespace) -> str | None:
    return ns.api_key or os.environ.get("PAGESTREAM_API_KEY")


async def run_frontend(ns: argparse.Namespace) -> None:
    """The public APIs over a remote scheduler; TLS flags secure both the public gRPC port
    (certificate and key) and the connection to the scheduler (CA, plus the same
    certificate and key for mutual TLS)."""
    from services.frontend.frontend_config import FrontendConfig
    from services.frontend.frontend_server import connect_frontend, serve_frontend
    from services.frontend.model_files import ModelFiles

    tls, config, tools = tls_config(ns), from_flags(FrontendConfig, ns), tool_options(ns)
    files = await asyncio.to_thread(ModelFiles.load, ns.model, ns.generation_config, True)
    router = router_config(ns)
    connecting = connect_frontend(
        ns.scheduler,
        files.tokenizer,
        files.default_sampling,
        tls=tls,
        config=config,
        router=router,
        images=files.images,
    )
    ready = asyncio.ensure_future(connecting)
    grpc_server = await serve_frontend(
        ready, ns.host, ns.grpc_port, tls=tls, api_key=_api_key(ns), config=config
    )
    frontend = await ready  # raises (and exits non-zero) when the scheduler never comes up
    load_lora_modules(frontend, ns)
    http = await start_http(frontend, ns, frontend.info.model, tools)
    schedulers = ", ".join(ns.scheduler)
    logger.info("frontend: gRPC on %s, scheduler(s) %s", grpc_server.address, schedulers)
    await serve_forever(ServerGroup(grpc_server, http, frontend.close), GRACE_S)


async def run_serve(ns: argparse.Namespace) -> None:
    """Every role on this machine, gRPC and HTTP in this process: the engine core in a
    process of its own (pagestream/engine_core_process.py), or, with --single-process,
    in this one too."""
    from pagestream.async_engine import AsyncEngine
    from services.frontend.frontend_config import FrontendConfig
    from services.frontend.frontend_server import serve_frontend

    config, tools = from_flags(FrontendConfig, ns), tool_options(ns)
    engine = await asyncio.to_thread(AsyncEngine, engine_args(ns), not ns.single_process, config)
    frontend = engine.frontend
    load_lora_modules(frontend, ns)
    grpc_server = await serve_frontend(
        frontend, ns.host, ns.grpc_port, tls=tls_config(ns), api_key=_api_key(ns), config=config
    )
    http = await start_http(frontend, ns, engine.info.model, tools)
    where = f"gRPC {grpc_server.address}" + (f", HTTP {http.url}" if http else "")
    layout = "one process" if ns.single_process else f"engine core in process {engine.process.pid}"
    logger.info("pagestream serving %s on %s (%s)", ns.model, where, layout)
    await serve_forever(ServerGroup(grpc_server, http, engine.shutdown), GRACE_S)
