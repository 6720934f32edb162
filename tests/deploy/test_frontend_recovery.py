"""The split deployment (worker, scheduler and frontend each behind gRPC) survives the loss
of a peer without restarting the frontend: the scheduler goes away mid-stream, every
stream ends with an error (not by its deadline), readiness turns off (gRPC health
NOT_SERVING, HTTP /ready 503) while liveness stays (HTTP /health 200), requests meanwhile
are refused (nothing waits for the peer to come back); a scheduler back on the same address
is found and the outputs equal those from before. The same for the workers behind the
scheduler."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.frontend.frontend_server import connect_frontend
from services.frontend.tokenizer import load_tokenizer
from services.scheduler.engine_core_service import serve_scheduler
from services.worker.worker_service import load_worker, serve_worker, start_worker_server
from tests.helpers.eventually import eventually_async
from tests.helpers.grpc_calls import PROMPT_IDS, collect, read_rest, request
from tests.helpers.servers import MODEL, engine_args, grpc_health, serving

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
STREAM_DEADLINE_S = 120  # a stream the loss did not end would end by this


@pytest.fixture
async def split(model_dir):
    folder = model_dir("llama")
    args = engine_args(folder, max_num_seqs=4)
    worker = await serve_worker(args.model_config(), args.cache_config())
    scheduler = await serve_scheduler(worker.address, args, worker_timeout_s=60)
    frontend = await connect_frontend(scheduler.address, load_tokenizer(folder), timeout_s=60)
    stack = SimpleNamespace(args=args, worker=worker, scheduler=scheduler, frontend=frontend)
    async with serving(frontend) as served:
        stack.served = served
        yield stack
    await frontend.close()
    await stack.scheduler.stop(0)
    await stack.worker.stop(0)


async def _http_status(served, path: str) -> int:
    async with served.http_client() as client:
        return (await client.get(path)).status_code


async def _completion(served, **fields):
    body = {"model": MODEL, "prompt": PROMPT_IDS, **GREEDY, **fields}
    async with served.http_client() as client:
        return await client.post("/v1/completions", json=body)


async def _assert_not_ready_but_alive(served) -> None:
    async def frontend_not_serving():
        return await grpc_health(served.grpc_address) == NOT_SERVING

    await eventually_async(frontend_not_serving, "frontend gRPC health NOT_SERVING")
    assert await grpc_health(served.grpc_address, "pagestream.v1.Generation") == NOT_SERVING
    assert await _http_status(served, "/ready") == 503
    assert await _http_status(served, "/health") == 200


async def _assert_refused(served) -> None:
    """Refused while the peer is away (the caller brings it back only afterwards): a request
    held until then would end by its deadline (DEADLINE_EXCEEDED, an HTTP timeout)."""
    async with served.stub() as stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub, request(PROMPT_IDS, **GREEDY))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    response = await _completion(served)
    assert response.status_code == 503, response.text


async def _wait_ready(served) -> None:
    async def ready():
        return await _http_status(served, "/ready") == 200

    await eventually_async(ready, "frontend ready again")
    assert await grpc_health(served.grpc_address) == SERVING


async def _greedy_tokens(served) -> list[int]:
    async with served.stub() as stub:
        responses = await collect(stub, request(PROMPT_IDS, **GREEDY))
    return [t for r in responses for t in r.token_ids]


async def _sse_events(lines) -> list:
    events = []
    async for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_a_lost_scheduler_ends_streams_and_the_frontend_serves_again(split):
    served = split.served
    before = await _greedy_tokens(served)
    long = {"temperature": 0, "max_tokens": 200, "ignore_eos": True}
    async with served.stub() as stub, served.http_client() as http:
        call = stub.Generate(request(PROMPT_IDS, **long))
        await call.read()  # streaming
        body = {"model": MODEL, "prompt": PROMPT_IDS, "stream": True, **long}
        async with http.stream("POST", "/v1/completions", json=body) as sse:
            lines = sse.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            port = split.scheduler.port
            await split.scheduler.stop(0)  # the scheduler goes away mid-stream
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await asyncio.wait_for(read_rest(call), STREAM_DEADLINE_S)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            events = await asyncio.wait_for(_sse_events(lines), STREAM_DEADLINE_S)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_unavailable"
    await _assert_not_ready_but_alive(served)
    await _assert_refused(served)

    split.scheduler = await serve_scheduler(
        split.worker.address, split.args, port=port, worker_timeout_s=60
    )
    await _wait_ready(served)
    assert await _greedy_tokens(served) == before
    response = await _completion(served)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"]


async def test_lost_workers_turn_the_frontend_not_ready_until_they_are_back(split):
    served = split.served
    before = await _greedy_tokens(served)
    port = split.worker.port
    await split.worker.stop(0)
    await _assert_not_ready_but_alive(served)
    await _assert_refused(served)
    split.worker = await start_worker_server("127.0.0.1", port)  # the fixture stops it
    await load_worker(split.worker, split.args.model_config(), split.args.cache_config())
    await _wait_ready(served)
    assert await _greedy_tokens(served) == before
    stats = await split.frontend.stats()
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0
