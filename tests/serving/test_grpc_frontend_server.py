"""The frontend's gRPC server: health, readiness, graceful stop and SIGTERM drain, and a
client that knows the API only through server reflection."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import serve_forever
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.frontend.frontend_server import connect_frontend, serve_frontend
from services.scheduler.engine_core_service import serve_engine_core
from tests.helpers.eventually import eventually_async
from tests.helpers.grpc_calls import (
    PROMPT_IDS,
    TEXT,
    TIMEOUT,
    collect,
    engine_idle,
    in_process,
    read_rest,
    reflected_method,
    request,
)


# ---- health, readiness, graceful stop ------------------------------------------------------
async def test_health_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagestream.v1.Generation"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_not_serving_until_ready_then_graceful_stop_drains(engine):
    gate = asyncio.Event()

    async def frontend_when_ready():
        await gate.wait()
        return engine.frontend

    handle = await serve_frontend(frontend_when_ready(), "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="pagestream.v1.Generation")
        watch = health.Watch(check, timeout=TIMEOUT)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, request(PROMPT_IDS, max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.set()
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        call = stub.Generate(request(PROMPT_IDS, max_tokens=20, ignore_eos=True), timeout=TIMEOUT)
        first = await call.read()
        stopping = asyncio.create_task(handle.stop(grace=TIMEOUT))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        rest = await read_rest(call)  # the in-flight stream finishes within the grace
        await asyncio.wait_for(stopping, TIMEOUT)  # and the open health watch does not hold it
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, request(PROMPT_IDS, max_tokens=2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    responses = [first, *rest]
    assert sum(len(r.token_ids) for r in responses) == 20
    assert responses[-1].finish_reason == "length" and responses[-1].HasField("usage")


async def test_stop_cancels_streams_that_outlive_the_grace(engine):
    handle = await serve_frontend(engine.frontend, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request(PROMPT_IDS, max_tokens=100_000, ignore_eos=True))
        await call.read()
        await asyncio.wait_for(handle.stop(grace=0.2), TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError):
            await read_rest(call)
    await eventually_async(lambda: engine_idle(engine), "the cut stream's request aborted")


async def test_sigterm_turns_not_serving_and_drains(engine):
    handle = await serve_frontend(engine.frontend, "127.0.0.1", 0)
    serving = asyncio.create_task(serve_forever(handle, grace=TIMEOUT))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request(PROMPT_IDS, max_tokens=20, ignore_eos=True), timeout=TIMEOUT)
        first = await call.read()
        # serve_forever has run up to its wait, so SIGTERM goes to its handler, not pytest.
        assert signal.SIGTERM in asyncio.get_running_loop()._signal_handlers
        signal.raise_signal(signal.SIGTERM)
        rest = await read_rest(call)
        await asyncio.wait_for(serving, TIMEOUT)
    assert sum(len(r.token_ids) for r in [first, *rest]) == 20
    assert rest[-1].finish_reason == "length" and rest[-1].HasField("usage")


# ---- a client that knows the API only through reflection -----------------------------------
async def test_reflection_only_client_gets_a_stream(grpc_server):
    target = f"127.0.0.1:{grpc_server.port}"
    request_class, response_class = await asyncio.to_thread(reflected_method, target, "Generate")
    assert request_class is not pb.GenerateRequest  # built from the server's descriptors
    message = request_class(text=TEXT)
    message.sampling_params.max_tokens = 5
    message.sampling_params.temperature = 0.0
    message.sampling_params.ignore_eos = True
    async with grpc.aio.insecure_channel(target) as channel:
        generate = channel.unary_stream(
            "/pagestream.v1.Generation/Generate",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        responses = [r async for r in generate(message, timeout=TIMEOUT)]
    assert sum(len(r.token_ids) for r in responses) == 5
    assert responses[-1].finish_reason == "length"
    assert responses[-1].usage.completion_tokens == 5
    assert responses[-1].usage.prompt_tokens == len(grpc_server.frontend.tokenizer.encode(TEXT))


# ---- the split deployment: Frontend over the scheduler's EngineCore service ------------------
async def test_split_frontend_streams_and_reports_a_lost_scheduler(engine):
    core_server = await serve_engine_core(engine.engine_core, engine.info, "127.0.0.1", 0)
    gate = asyncio.Event()

    async def frontend_when_connected():
        await gate.wait()
        return await connect_frontend(core_server.address, engine.tokenizer, timeout_s=TIMEOUT)

    handle = await serve_frontend(frontend_when_connected(), "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(handle.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        gate.set()
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stub = generation_pb2_grpc.GenerationStub(channel)
        greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
        responses = await collect(stub, request(PROMPT_IDS, **greedy))
        local = await in_process(engine, {"prompt_token_ids": PROMPT_IDS}, SamplingParams(**greedy))
        assert [t for r in responses for t in r.token_ids] == local.outputs[0].token_ids
        assert responses[-1].usage.completion_tokens == 6
        await core_server.stop(None)  # the scheduler goes away
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, request(PROMPT_IDS, **greedy))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    await handle.stop(grace=None)
    await handle.frontend.close()
