"""`pagestream serve --models-dir DIR` / `--models-preset FILE`: many models behind one HTTP
server (ModelDispatcher over a ModelRegistry), each model's engine core a child process
started on first use.

MODEL, when given too, is one more model: the default (a request without `model` gets it)
and pinned (loaded at start, never unloaded). Without MODEL the default is the preset's
first table (else the directory's first entry by name). The public gRPC port (--grpc-port)
serves every model too: each call's `model` picks one (RegistryFrontends).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from pagestream import roles
from pagestream.engine_core_process import spare_pool
from pagestream.engine_core_spare import SparePool
from pagestream.models.loaded_model import ModelLoader
from pagestream.models.model_catalog import build_specs
from pagestream.models.model_dispatcher import ModelDispatcher
from pagestream.models.model_registry import ModelRegistry
from pagestream.models.models_config import ModelsConfig
from pagestream.models.registry_frontends import RegistryFrontends
from services.common.flags import from_flags
from services.common.grpc_server import serve_forever
from services.frontend.frontend_config import FrontendConfig
from services.frontend.lora_options import LoRAServerOptions

logger = logging.getLogger("pagestream")

REFUSED_WITH = (
    ("single_process", "--single-process"),
    ("split_services", "--split-services"),
)


def check_models_serve(ns: argparse.Namespace) -> ModelsConfig:
    """The layouts many models refuse, each by its flag; the config otherwise."""
    config = from_flags(ModelsConfig, ns)
    config.check()
    for attr, flag in REFUSED_WITH:
        if getattr(ns, attr, False):
            raise ValueError(f"{flag} serves one model: it does not go with --models-dir.")
    if getattr(ns, "data_parallel_size", 1) > 1:
        raise ValueError("--data-parallel-size serves one model: not with --models-dir.")
    if ns.port is None or ns.port < 0:
        raise ValueError("--port: many models are served over HTTP only; give a port >= 0.")
    if getattr(ns, "lora_modules", None):
        raise ValueError("--lora-modules serves one model's adapters: not with --models-dir.")
    return config


class ModelsServer:
    """The HTTP server, the gRPC server and the registry, stopped together (HTTP first,
    the models last)."""

    def __init__(self, http, grpc_server, registry: ModelRegistry, spares: SparePool) -> None:
        self.http, self.grpc_server, self.registry = http, grpc_server, registry
        self.spares = spares

    async def stop(self, grace: float | None = roles.GRACE_S) -> None:
        await self.http.stop()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)
        await self.registry.close()
        await asyncio.to_thread(self.spares.close)

    async def wait_for_termination(self) -> None:
        await self.http.wait()


async def start_models_server(ns: argparse.Namespace) -> ModelsServer:
    from services.frontend.frontend_server import serve_frontend
    from services.frontend.openai.http_server import serve_http

    config = check_models_serve(ns)
    specs = await asyncio.to_thread(build_specs, ns, config)
    frontend_config, api_key = from_flags(FrontendConfig, ns), roles._api_key(ns)
    spares = spare_pool()
    loader = ModelLoader(
        frontend_config,
        api_key,
        roles.tool_options(ns),
        from_flags(LoRAServerOptions, ns),
        spares,
    )
    registry = ModelRegistry(specs, loader, config)
    registry.start()
    app = ModelDispatcher(registry, api_key, frontend_config.max_request_body_bytes)
    http = await serve_http(app, ns.host, ns.port)
    try:
        if ns.model is not None:  # the default model, pinned: loaded before the server returns
            await registry.load(registry.default_name)
        grpc_server = await serve_frontend(
            RegistryFrontends(registry),
            ns.host,
            ns.grpc_port,
            tls=roles.tls_config(ns),
            api_key=api_key,
            config=frontend_config,
        )
        spares.refill()  # after the pinned load: a first request's load skips the imports
    except BaseException:  # e.g. the gRPC port taken: nothing is left running
        await http.stop()
        await registry.close()
        await asyncio.to_thread(spares.close)
        raise
    names = ", ".join(registry.entries)
    where = f"HTTP {http.url}, gRPC {grpc_server.address}"
    logger.info("pagestream serving %d models on %s: %s", len(specs), where, names)
    return ModelsServer(http, grpc_server, registry, spares)


async def run_models_serve(ns: argparse.Namespace) -> None:
    server = await start_models_server(ns)
    await serve_forever(server, roles.GRACE_S)
