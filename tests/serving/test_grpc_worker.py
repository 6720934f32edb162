"""The Worker service over gRPC: a scheduler-side EngineCore on WorkerGroupExecutor (one
rank) matches the in-process path, bad plans are answered without killing the stream,
health and reflection."""

import asyncio
from collections import defaultdict

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagestream.engine_args import EngineArgs
from services.common.config import SchedulerConfig
from services.common.engine_request import EngineCoreRequest
from services.common.grpc_channel import aio_channel
from services.common.proto.pagestream.internal.v1 import worker_pb2, worker_pb2_grpc
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor.executor import WorkerStepError
from services.scheduler.executor.uni import UniExecutor
from services.scheduler.executor.worker_group import WorkerGroupExecutor
from services.scheduler.scheduler import Scheduler
from services.worker.worker import Worker
from services.worker.worker_service import (
    WORKER_SERVICE,
    load_worker,
    serve_worker,
    start_worker_server,
)

TIMEOUT_S = 60
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Small token budget: the longer prompts prefill in chunks, mixed with other decodes.
SCHEDULER = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)
PROMPTS = [[5, 17, 33, 99, 250, 12, 8, 41], list(range(3, 40)), [7], list(range(100, 121))]


def _args(model_dir) -> EngineArgs:
    return EngineArgs(model=str(model_dir("llama")), kv_cache_memory="8MiB", swap_space=0.01)


@pytest.fixture
async def worker_server(model_dir):
    args = _args(model_dir)
    server = await serve_worker(args.model_config(), args.cache_config())
    yield server
    await server.stop(0)


@pytest.fixture
async def executor(worker_server):
    executor = WorkerGroupExecutor([worker_server.address])
    yield executor
    await asyncio.to_thread(executor.close)


def _requests() -> list[EngineCoreRequest]:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    scored = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    requests = [EngineCoreRequest(f"r{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    return [*requests, EngineCoreRequest("scored", PROMPTS[1], scored)]


def _run_to_completion(core: EngineCore, requests) -> dict:
    """Every request's token ids, logprobs and prompt logprobs, stepping until done."""
    for request in requests:
        core.add_request(request)
    seen = defaultdict(lambda: {"tokens": [], "logprobs": [], "prompt_logprobs": []})
    while core.has_work():
        for batch in core.step().values():
            for out in batch.outputs:
                seen[out.request_id]["tokens"] += out.new_token_ids
                seen[out.request_id]["logprobs"] += out.new_logprobs or []
                seen[out.request_id]["prompt_logprobs"] += out.new_prompt_logprobs or []
    return dict(seen)


def _core(executor, cache_info, cache_config) -> EngineCore:
    scheduler = Scheduler(
        SCHEDULER, cache_config, cache_info.num_device_blocks, cache_info.num_cpu_blocks
    )
    return EngineCore(scheduler, executor)


async def test_grpc_executor_matches_the_in_process_worker(model_dir, executor, hf_greedy):
    args = _args(model_dir)
    local = Worker(args.model_config(), args.cache_config())
    local_info = local.initialize_cache(256, 8, 16)
    remote_info = await asyncio.to_thread(executor.initialize_cache, 256, 8, 16)
    assert vars(remote_info) == vars(local_info)  # same fields, whichever side built them
    expected = _run_to_completion(
        _core(UniExecutor(local), local_info, args.cache_config()), _requests()
    )
    core = _core(executor, remote_info, args.cache_config())
    got = await asyncio.wait_for(
        asyncio.to_thread(_run_to_completion, core, _requests()), TIMEOUT_S
    )
    assert got == expected
    assert got["r0"]["tokens"] == hf_greedy(model_dir("llama"), PROMPTS[0], 8)
    assert len(got["r1"]["logprobs"]) == 8 and len(got["scored"]["prompt_logprobs"]) == 37
    assert got["scored"]["prompt_logprobs"][0] is None


def _new_plan(request_id: str, prompt: list[int]) -> SchedulerOutput:
    new = NewRequestData(request_id, prompt, [], SamplingParams(temperature=0.0), ([0],), 0)
    return SchedulerOutput(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={request_id: len(prompt)},
        total_num_scheduled_tokens=len(prompt),
    )


def _run(executor, plan):
    return executor.execute(plan).result()


async def test_a_plan_for_an_unknown_request_gets_an_error_and_the_stream_goes_on(executor):
    await asyncio.to_thread(executor.initialize_cache, 256, 8, 64)
    ghost = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["ghost"], [([],)], [3], [False]),
        num_scheduled_tokens={"ghost": 1},
        total_num_scheduled_tokens=1,
    )
    with pytest.raises(WorkerStepError, match="ghost"):
        await asyncio.to_thread(_run, executor, ghost)
    result = await asyncio.to_thread(_run, executor, _new_plan("fresh", [1, 2, 3]))
    assert result.request_ids == ["fresh"] and len(result.sampled_token_ids[0]) == 1
    assert (await asyncio.to_thread(executor.describe)).vocab_size == 512


async def test_executor_raises_connection_error_when_the_worker_is_gone(worker_server):
    executor = WorkerGroupExecutor([worker_server.address])
    try:
        await asyncio.to_thread(executor.initialize_cache, 256, 8, 64)
        await asyncio.to_thread(_run, executor, _new_plan("a", [1, 2]))
        await worker_server.stop(0)
        with pytest.raises(ConnectionError, match=worker_server.address):
            await asyncio.wait_for(
                asyncio.to_thread(_run, executor, _new_plan("b", [3])), TIMEOUT_S
            )
        with pytest.raises(ConnectionError, match=worker_server.address):
            await asyncio.to_thread(executor.describe, 5.0)
    finally:
        await asyncio.to_thread(executor.close)


async def _status(channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return response.status


async def test_health_is_not_serving_until_loaded_and_first_thing_on_stop(model_dir):
    server = await start_worker_server()
    channel = aio_channel(server.address)
    try:
        assert await _status(channel, WORKER_SERVICE) == NOT_SERVING
        assert await _status(channel, "") == NOT_SERVING
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        args = _args(model_dir)
        await load_worker(server, args.model_config(), args.cache_config())
        assert await _status(channel, WORKER_SERVICE) == SERVING
        assert (await stub.Describe(worker_pb2.DescribeRequest(), timeout=10)).num_layers == 2
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=TIMEOUT_S
        )
        assert (await watch.read()).status == SERVING
        stopping = asyncio.create_task(server.stop(grace=5.0))
        assert (await asyncio.wait_for(watch.read(), TIMEOUT_S)).status == NOT_SERVING
        watch.cancel()
        await asyncio.wait_for(stopping, TIMEOUT_S)
    finally:
        await server.stop(0)
        await channel.close()


async def test_reflection_lists_the_worker_service(worker_server):
    channel = aio_channel(worker_server.address)
    try:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            timeout=TIMEOUT_S
        )
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        await call.done_writing()
        names = {s.name for s in response.list_services_response.service}
        assert {WORKER_SERVICE, "grpc.health.v1.Health"} <= names
    finally:
        await channel.close()
