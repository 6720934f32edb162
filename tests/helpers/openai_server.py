"""A real uvicorn server (port 0, loopback) over the in-process engine, for the OpenAI API
tests. It runs on the test's event loop, the same loop as the engine."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import openai
from prometheus_client.parser import text_string_to_metric_families

from pagestream import AsyncEngine, EngineArgs
from services.frontend.frontend_config import FrontendConfig
from services.frontend.openai import HttpServer, build_app, serve_http
from tests.helpers.eventually import eventually_async

try:  # recent openai clients ship httpx as "httpx2"
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

API_KEY = "test-key"
MODEL = "tiny-llama"
TIMEOUT = 60.0


@dataclass
class OpenAIServer:
    engine: AsyncEngine
    http: HttpServer
    app: object
    _sync: openai.OpenAI | None = None
    _async: openai.AsyncOpenAI | None = None

    @property
    def base_url(self) -> str:
        return f"{self.http.url}/v1"

    def sync_client(self) -> openai.OpenAI:
        """One client per server (closed with it); call it from a thread, not the loop."""
        if self._sync is None:
            self._sync = openai.OpenAI(
                base_url=self.base_url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT
            )
        return self._sync

    def async_client(self) -> openai.AsyncOpenAI:
        if self._async is None:
            self._async = openai.AsyncOpenAI(
                base_url=self.base_url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT
            )
        return self._async

    async def close_clients(self) -> None:
        if self._sync is not None:
            await asyncio.to_thread(self._sync.close)
        if self._async is not None:
            await self._async.close()

    def raw(self, api_key: str | None = API_KEY) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.AsyncClient(base_url=self.http.url, headers=headers, timeout=TIMEOUT)

    async def disconnect_while_running(self, path: str, body: dict) -> None:
        """POST `body` to `path`, then go away while the server still works on it."""

        async def post():
            async with self.raw() as client:
                await client.post(path, json=body)

        task = asyncio.create_task(post())
        frontend = self.engine.frontend
        await eventually_async(lambda: frontend.num_live_requests() > 0, "the request running")
        task.cancel()  # the client goes away while the server is still working
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled(), "the request ended before the client went away"

    async def metrics(self) -> dict[str, float]:
        """Samples as {'name{label="v"}': value} from GET /metrics."""
        async with self.raw(api_key=None) as client:
            response = await client.get("/metrics")
        assert response.status_code == 200
        samples = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    async def wait_until_idle(self) -> dict[str, float]:
        """/metrics once no request runs or waits and no KV block is in use."""

        async def idle() -> dict[str, float] | None:
            samples = await self.metrics()
            quiet = (
                samples['pagestream:num_requests_running{engine="0"}'] == 0
                and samples['pagestream:num_requests_waiting{engine="0"}'] == 0
                and samples['pagestream:kv_cache_usage_perc{engine="0"}'] == 0
            )
            return samples if quiet else None

        return await eventually_async(idle, "the server idle (/metrics)", interval=0.02)


@contextlib.asynccontextmanager
async def running_server(
    folder,
    api_key: str | None = API_KEY,
    app_options: dict | None = None,
    frontend_config: FrontendConfig | None = None,
    **engine_args,
):
    """An OpenAI server over an in-process engine (`app_options`: more build_app args,
    `frontend_config`: the frontend's flags)."""
    engine_args.setdefault("kv_cache_memory", "8MiB")
    args = EngineArgs.from_kwargs(model=str(folder), **engine_args)
    engine = AsyncEngine(args, False, frontend_config)
    app = build_app(engine.frontend, [MODEL], api_key=api_key, **(app_options or {}))
    http = await serve_http(app, "127.0.0.1", 0)
    server = OpenAIServer(engine, http, app)
    try:
        yield server
    finally:
        await server.close_clients()
        await asyncio.wait_for(http.stop(), timeout=30)
        await engine.shutdown()
