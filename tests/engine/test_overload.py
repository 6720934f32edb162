"""Overload is refused cleanly: with --max-num-seqs 2 --max-waiting-requests 4, 30
concurrent requests see the excess refused at once (HTTP 429 with Retry-After, gRPC
RESOURCE_EXHAUSTED), every admitted request completes in full, nothing answers 5xx,
and the KV cache is empty afterwards. Over HTTP on the in-process engine, and over the
public gRPC API of the split deployment (scheduler behind gRPC)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from pagestream import AsyncEngine
from services.common.engine_errors import EngineOverloadedError
from services.common.flags import to_flags
from services.frontend.frontend_server import connect_frontend
from services.frontend.tokenizer import load_tokenizer
from services.scheduler.engine_core_service import serve_scheduler
from services.worker.worker_service import serve_worker
from tests.engine.grpc_helpers import PROMPT_IDS, request
from tests.frontend.servers import ENGINE, MODEL, engine_args, kv_idle, serving, wait_for

NUM_REQUESTS = 30
MAX_TOKENS = 24
OVERLOAD = dict(max_num_seqs=2, max_waiting_requests=4)


def test_engine_args_carry_the_bound_to_the_scheduler():
    args = engine_args("unused", **OVERLOAD)
    assert args.scheduler_config(256).max_waiting_requests == 4
    assert "--max-waiting-requests" in to_flags(args)
    assert engine_args("unused").scheduler_config(256).max_waiting_requests == 0  # Python API
    with pytest.raises(ValueError, match="max_waiting_requests"):
        engine_args("unused", max_waiting_requests=-1).scheduler_config(256)


async def _http_request(served, index: int):
    body = {
        "model": MODEL,
        "prompt": PROMPT_IDS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": index % 2 == 1,
    }
    async with served.http_client() as client:
        response = await client.post("/v1/completions", json=body)
        return response, response.text


async def test_overload_over_http_is_429_and_admitted_requests_complete(model_dir):
    engine = AsyncEngine.from_args(
        str(model_dir("llama")), engine_core_process=False, **ENGINE, **OVERLOAD
    )
    try:
        async with serving(engine.frontend) as served:
            results = await asyncio.gather(*(_http_request(served, i) for i in range(NUM_REQUESTS)))
            statuses = Counter(response.status_code for response, _ in results)
            assert set(statuses) == {200, 429}, statuses
            assert statuses[429] >= 1 and statuses[200] >= 4, statuses  # 4 wait at least
            for response, text in results:
                if response.status_code == 429:
                    assert response.headers["retry-after"] == "1"
                    assert response.json()["error"]["code"] == "rate_limit_exceeded"
                    assert "max_waiting_requests=4" in response.json()["error"]["message"]
                elif response.headers["content-type"].startswith("text/event-stream"):
                    assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
                    assert text.count('"finish_reason":"length"') == 1
                else:
                    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS

            async def idle():
                return await kv_idle(engine.frontend.stats)

            await wait_for(idle, 30, "the KV cache empty")
    finally:
        await engine.shutdown()


async def test_overload_over_grpc_is_resource_exhausted_in_the_split_deployment(model_dir):
    folder = model_dir("llama")
    args = engine_args(folder, **OVERLOAD)
    worker = await serve_worker(args.model_config(), args.cache_config())
    scheduler = await serve_scheduler(worker.address, args, worker_timeout_s=60)
    frontend = await connect_frontend(scheduler.address, load_tokenizer(folder), timeout_s=60)
    try:
        async with serving(frontend) as served, served.stub() as stub:
            message = request(PROMPT_IDS, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

            async def one():
                try:
                    responses = [r async for r in stub.Generate(message, timeout=60)]
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details()
                return sum(len(r.token_ids) for r in responses), None

            results = await asyncio.gather(*(one() for _ in range(NUM_REQUESTS)))
        codes = Counter(code for code, _ in results)
        assert set(codes) == {MAX_TOKENS, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert codes[MAX_TOKENS] >= 4, codes
        refused = [d for c, d in results if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert all("max_waiting_requests=4" in d for d in refused)
        await wait_for(lambda: kv_idle(frontend.stats), 30, "the KV cache empty")
    finally:
        await frontend.close()
        await scheduler.stop(0)
        await worker.stop(0)


async def test_preempted_requests_are_never_refused():
    """The bound counts waiting requests at admission only: a request already admitted
    that goes back to the waiting queue (preemption) is not refused."""
    from services.common.config import CacheConfig, SchedulerConfig
    from services.common.sampling_params import SamplingParams
    from services.scheduler.request import Request
    from services.scheduler.scheduler import Scheduler

    scheduler = Scheduler(SchedulerConfig(max_waiting_requests=2), CacheConfig(), 64)
    params = SamplingParams(max_tokens=2)
    for i in range(2):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3], params))
    with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
        scheduler.add_request(Request("r2", [1, 2, 3], params))
    assert list(scheduler.requests) == ["r0", "r1"]  # nothing half-admitted
    scheduler.schedule()  # both run now: room again
    scheduler.add_request(Request("r2", [1, 2, 3], params))
    scheduler.add_request(Request("r3", [1, 2, 3], params))
    scheduler.waiting.appendleft(scheduler.running.pop())  # as preemption does
    assert len(scheduler.waiting) == 3
