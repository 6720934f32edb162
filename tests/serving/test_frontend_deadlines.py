"""Deadlines and disconnects free the engine: a gRPC deadline that passes, an HTTP client
that times out (streaming or not) or goes away, and the server's own --request-timeout
each abort the request in the engine core, and the KV cache is empty again, with no request
run to its end (finish reason "length"). The step is slowed down so that every request
outlives its deadline."""

from __future__ import annotations

import time

import grpc
import pytest

from services.frontend.frontend_config import FrontendConfig
from tests.helpers.eventually import eventually_async
from tests.helpers.grpc_calls import PROMPT_IDS, request
from tests.helpers.servers import ENGINE, MODEL, inproc_frontend, kv_idle, serving

try:  # recent openai clients ship httpx as "httpx2"
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

STEP_DELAY_S = 0.05  # x 240 tokens: a request would run for 12 s at least
DEADLINE_S = 0.5
LONG = {"temperature": 0, "max_tokens": 240, "ignore_eos": True}


ENGINE_ARGS = ENGINE  # for tests/conftest.py's engine


@pytest.fixture
def finishes() -> list[str]:
    """The finish reason of every request the engine core ended, from the slowed step."""
    return []


@pytest.fixture
def engine(engine, finishes, monkeypatch):
    """tests/conftest.py's engine with every step slowed down (and its finishes recorded)."""
    core = engine.engine_core.core
    step = core.step

    def slow_step():
        time.sleep(STEP_DELAY_S)
        outputs = step()
        for batch in outputs.values():
            finishes.extend(o.finish_reason for o in batch.outputs if o.finish_reason)
        return outputs

    monkeypatch.setattr(core, "step", slow_step)
    return engine


async def _freed(engine, finishes) -> None:
    """Idle again, and not because a request ran to its end: it was aborted."""

    async def idle():
        return await kv_idle(engine.frontend.stats)

    await eventually_async(idle, "the request aborted and its KV blocks freed")
    assert "length" not in finishes, finishes


async def _running(engine) -> None:
    async def busy():
        return (await engine.frontend.stats()).kv_cache_usage > 0

    await eventually_async(busy, "the request running")


async def test_a_grpc_deadline_aborts_the_request_and_frees_its_blocks(engine, finishes):
    async with serving(engine.frontend) as served, served.stub() as stub:
        call = stub.Generate(request(PROMPT_IDS, **LONG), timeout=DEADLINE_S)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            async for _ in call:
                pass
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await _freed(engine, finishes)
        assert engine.frontend.num_live_requests() == 0


async def test_an_http_client_timeout_aborts_the_request_and_frees_its_blocks(engine, finishes):
    body = {"model": MODEL, "prompt": PROMPT_IDS, **LONG}
    async with serving(engine.frontend) as served:
        async with served.http_client(timeout=DEADLINE_S) as client:
            with pytest.raises(httpx.TimeoutException):
                await client.post("/v1/completions", json=body)
        await _freed(engine, finishes)


async def test_an_http_client_that_goes_away_mid_stream_frees_its_blocks(engine, finishes):
    body = {"model": MODEL, "prompt": PROMPT_IDS, "stream": True, **LONG}
    async with serving(engine.frontend) as served, served.http_client() as client:
        async with client.stream("POST", "/v1/completions", json=body) as sse:
            lines = sse.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            await _running(engine)
        # leaving the block closes the connection mid-stream
        await _freed(engine, finishes)


async def test_the_server_request_timeout_ends_requests_with_an_error(engine, finishes):
    frontend = inproc_frontend(engine, FrontendConfig(request_timeout_s=DEADLINE_S))
    try:
        async with serving(frontend) as served:
            async with served.stub() as stub:
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    async for _ in stub.Generate(request(PROMPT_IDS, **LONG), timeout=60):
                        pass
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--request-timeout" in late.value.details()
            await _freed(engine, finishes)
            async with served.http_client() as client:
                body = {"model": MODEL, "prompt": PROMPT_IDS, **LONG}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 504
                assert response.json()["error"]["code"] == "request_timeout"
                await _freed(engine, finishes)
                streamed = await client.post("/v1/completions", json={**body, "stream": True})
                assert streamed.status_code == 200  # the stream had started
                assert '"code": "request_timeout"' in streamed.text
                assert streamed.text.rstrip().endswith("data: [DONE]")
            await _freed(engine, finishes)
            assert frontend.num_live_requests() == 0
    finally:
        await frontend.close()
