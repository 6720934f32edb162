"""Frontends with their own FrontendConfig behind real servers (port 0, loopback), for the
fault, overload, deadline, limit and security tests (tests/serving, tests/deploy)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagestream import AsyncEngine
from pagestream.engine_args import EngineArgs
from pagestream.inproc_client import InprocEngineCoreClient
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.frontend.frontend import Frontend
from services.frontend.frontend_config import FrontendConfig
from services.frontend.frontend_server import FrontendServer, serve_frontend
from services.frontend.openai import HttpServer, build_app, serve_http

try:  # recent openai clients ship httpx as "httpx2"
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

MODEL = "tiny-llama"
TIMEOUT = 60.0
ENGINE = dict(kv_cache_memory="8MiB", swap_space=0.01)


def engine_args(folder, **overrides) -> EngineArgs:
    return EngineArgs(model=str(folder), **{**ENGINE, **overrides})


def inproc_frontend(engine: AsyncEngine, config: FrontendConfig | None = None) -> Frontend:
    """A Frontend with `config` over an AsyncEngine's core (as `pagestream serve` builds)."""
    client = InprocEngineCoreClient(engine.engine_core)
    return Frontend(client, engine.tokenizer, engine.info, engine.engine.default_sampling, config)


@dataclass
class Served:
    """A Frontend behind the public gRPC API and the OpenAI HTTP API."""

    frontend: Frontend
    grpc: FrontendServer
    http: HttpServer

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc.port}"

    def http_client(
        self, api_key: str | None = None, timeout: float = TIMEOUT
    ) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.AsyncClient(base_url=self.http.url, headers=headers, timeout=timeout)

    @contextlib.asynccontextmanager
    async def stub(self):
        async with grpc.aio.insecure_channel(self.grpc_address) as channel:
            yield generation_pb2_grpc.GenerationStub(channel)


@contextlib.asynccontextmanager
async def serving(frontend: Frontend, api_key: str | None = None, tls=None):
    """Serve `frontend` over gRPC and HTTP; the caller keeps owning the Frontend."""
    grpc_server = await serve_frontend(frontend, "127.0.0.1", 0, tls=tls, api_key=api_key)
    http = await serve_http(build_app(frontend, [MODEL], api_key=api_key), "127.0.0.1", 0)
    try:
        yield Served(frontend, grpc_server, http)
    finally:
        await asyncio.wait_for(http.stop(), 30)
        await grpc_server.stop(grace=None)


async def grpc_health(address: str, service: str = "") -> int | None:
    """The server's grpc.health.v1 status, or None when it does not answer."""
    async with grpc.aio.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        except grpc.aio.AioRpcError:
            return None
        return reply.status


async def kv_idle(stats) -> bool:
    """No request running or waiting and no KV block in use (`stats`: an async callable)."""
    s = await stats()
    return s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.kv_cache_usage == 0.0
