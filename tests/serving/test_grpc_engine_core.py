"""The EngineCore service: a Frontend over GrpcEngineCoreClient (scheduler and worker each
behind gRPC) streams what the in-process AsyncEngine does; rejections come back as errors;
a frontend that goes away aborts its requests; a lost worker makes the engine UNAVAILABLE."""

import asyncio
from types import SimpleNamespace

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagestream import AsyncEngine
from pagestream.engine_args import EngineArgs
from services.common.engine_errors import EngineUnavailableError
from services.common.engine_request import EngineCoreRequest
from services.common.grpc_channel import aio_channel
from services.common.sampling_params import SamplingParams
from services.frontend.frontend import Frontend
from services.frontend.grpc_engine_client import GrpcEngineCoreClient
from services.frontend.tokenizer import load_tokenizer
from services.scheduler.engine_core_service import ENGINE_CORE_SERVICE, serve_scheduler
from services.worker.worker_service import load_worker, serve_worker, start_worker_server
from tests.helpers.eventually import eventually_async

TIMEOUT_S = 60
ENGINE = dict(kv_cache_memory="8MiB", swap_space=0.01, max_num_seqs=4)
PROMPT_IDS = {"prompt_token_ids": [5, 17, 33, 99, 250, 12, 8, 41]}


@pytest.fixture
async def stack(model_dir):
    folder = str(model_dir("llama"))
    args = EngineArgs(model=folder, **ENGINE)
    worker = await serve_worker(args.model_config(), args.cache_config())
    scheduler = await serve_scheduler(worker.address, args, worker_timeout_s=TIMEOUT_S)
    client = await GrpcEngineCoreClient.connect(scheduler.address, timeout_s=TIMEOUT_S)
    info = await client.get_engine_info()
    frontend = Frontend(client, load_tokenizer(folder), info)
    stack = SimpleNamespace(worker=worker, scheduler=scheduler, frontend=frontend, info=info)
    yield stack
    await frontend.close()
    await scheduler.stop(0)
    await stack.worker.stop(0)  # a test may have replaced it
    if stack.worker is not worker:
        await worker.stop(0)


@pytest.fixture
async def local(model_dir):
    engine = AsyncEngine.from_args(str(model_dir("llama")), engine_core_process=False, **ENGINE)
    yield engine
    await engine.shutdown()


async def _final(frontend, prompt, params, request_id):
    outputs = [o async for o in frontend.generate(prompt, params, request_id)]
    return len(outputs), outputs[-1]


def _positions(positions, approx: bool):
    """Token ids and ranks exactly; values to 1e-4 (batch composition moves the last bits)."""
    if positions is None:
        return None
    value = (lambda v: pytest.approx(v, abs=1e-4)) if approx else (lambda v: v)
    return [
        None if p is None else sorted((t, lp.rank, value(lp.logprob)) for t, lp in p.items())
        for p in positions
    ]


def _summary(output, approx: bool = False):
    completions = [
        (c.index, c.token_ids, c.text, c.finish_reason, _positions(c.logprobs, approx))
        for c in output.outputs
    ]
    return output.prompt_token_ids, _positions(output.prompt_logprobs, approx), completions


async def _run_all(frontend, workload):
    runs = [_final(frontend, prompt, params, rid) for rid, (prompt, params) in workload.items()]
    return await asyncio.wait_for(asyncio.gather(*runs), TIMEOUT_S)


async def test_grpc_frontend_streams_what_the_in_process_engine_does(stack, local):
    assert stack.info == local.info
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _, reference = await _final(local.frontend, "The quick brown fox", greedy, "probe")
    stop = reference.outputs[0].text[4:7]  # stops mid-stream: an abort over the stream
    workload = {
        "text": ("The quick brown fox", greedy),
        "ids": (PROMPT_IDS, greedy.clone(max_tokens=6, logprobs=2, prompt_logprobs=1)),
        "stop": ("The quick brown fox", greedy.clone(stop=[stop])),
        "n2": (PROMPT_IDS, SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=5)),
    }
    expected = await _run_all(local.frontend, workload)
    got = await _run_all(stack.frontend, workload)
    assert [_summary(o) for _, o in got] == [_summary(o, approx=True) for _, o in expected]
    assert got[0][0] > 1  # it streamed
    assert got[2][1].outputs[0].finish_reason == "stop"
    assert len(got[2][1].outputs[0].token_ids) < 12


async def test_rejected_requests_come_back_as_errors_not_hangs(stack):
    with pytest.raises(ValueError, match="max_num_seqs"):
        params = SamplingParams(n=5, temperature=1.0, max_tokens=2)
        await asyncio.wait_for(_final(stack.frontend, PROMPT_IDS, params, "too-many"), TIMEOUT_S)
    # Past max_model_len, as token ids straight to the engine core (no frontend check).
    raw = await GrpcEngineCoreClient.connect(stack.scheduler.address, timeout_s=TIMEOUT_S)
    try:
        too_long = [3] * (stack.info.max_model_len + 1)
        await raw.add_request(EngineCoreRequest("too-long", too_long, SamplingParams()))
        batch = await asyncio.wait_for(raw.next_outputs(), TIMEOUT_S)
        (output,) = batch.outputs
        assert output.request_id == "too-long" and output.finish_reason == "error"
        assert "max_model_len" in output.error
    finally:
        await raw.close()
    # The streams carry on.
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    _, output = await asyncio.wait_for(_final(stack.frontend, PROMPT_IDS, greedy, "ok"), TIMEOUT_S)
    assert len(output.outputs[0].token_ids) == 3


async def test_the_scheduler_waits_for_a_worker_that_is_still_loading(model_dir):
    args = EngineArgs(model=str(model_dir("llama")), **ENGINE)
    worker = await start_worker_server()
    starting = asyncio.create_task(
        serve_scheduler(worker.address, args, worker_timeout_s=TIMEOUT_S)
    )
    try:
        # Not an error, not done: it is waiting for the worker to report SERVING.
        done, _ = await asyncio.wait({starting}, timeout=0.3)
        assert not done
        await load_worker(worker, args.model_config(), args.cache_config())
        scheduler = await asyncio.wait_for(starting, TIMEOUT_S)
        client = await GrpcEngineCoreClient.connect(scheduler.address, timeout_s=TIMEOUT_S)
        assert (await client.get_engine_info()).vocab_size == 512
        await client.close()
        await scheduler.stop(0)
    finally:
        starting.cancel()
        await worker.stop(0)


async def test_a_frontend_that_disconnects_aborts_its_requests(stack):
    leaving = await GrpcEngineCoreClient.connect(stack.scheduler.address, timeout_s=TIMEOUT_S)
    forever = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    await leaving.add_request(EngineCoreRequest("long", PROMPT_IDS["prompt_token_ids"], forever))
    batch = await asyncio.wait_for(leaving.next_outputs(), TIMEOUT_S)
    assert batch.outputs[0].request_id == "long" and not batch.outputs[0].finished
    observer = stack.frontend.client
    stats = await observer.stats()
    assert stats.kv_cache_usage > 0 and stats.num_running_reqs == 1
    await leaving.close()

    # poll GetStats (nothing to await: the abort happens inside the engine core)
    async def none_running():
        stats = await observer.stats()
        return stats if stats.num_running_reqs == 0 else None

    stats = await eventually_async(none_running, "the left frontend's request aborted")
    assert stats.kv_cache_usage == 0.0 and stats.num_waiting_reqs == 0


async def test_a_frontend_aborts_only_its_own_request_of_a_shared_id(stack):
    """Request ids are one namespace across frontends: another frontend's add of the same
    id is refused as in use, and its abort of that id (its caller gone before the refusal
    came) leaves the first frontend's request running to its end."""
    other = await GrpcEngineCoreClient.connect(stack.scheduler.address, timeout_s=TIMEOUT_S)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = stack.frontend.generate(PROMPT_IDS, params, "shared")
    try:
        first = await asyncio.wait_for(anext(stream), TIMEOUT_S)  # admitted, running
        prompt = PROMPT_IDS["prompt_token_ids"]
        await other.add_request(EngineCoreRequest("shared", prompt, params))
        await other.abort(["shared"])  # written right behind the add
        batch = await asyncio.wait_for(other.next_outputs(), TIMEOUT_S)
        (refused,) = batch.outputs
        assert refused.finish_reason == "error" and "already in use" in refused.error
    finally:
        await other.close()
    outputs = [first] + [o async for o in stream]
    completion = outputs[-1].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 200


async def _engine_core_status(address: str) -> int:
    channel = aio_channel(address)
    try:
        request = health_pb2.HealthCheckRequest(service=ENGINE_CORE_SERVICE)
        response = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=TIMEOUT_S)
        return response.status
    finally:
        await channel.close()


async def _wait_status(address: str, status: int) -> None:
    async def reached():
        return await _engine_core_status(address) == status

    await eventually_async(reached, f"EngineCore health {status}")


async def test_a_lost_worker_fails_its_requests_and_the_engine_recovers(stack, model_dir):
    """Worker gone mid-stream: the stream ends with EngineUnavailableError (not by running
    out of time), the EngineCore turns NOT_SERVING and refuses new work as unavailable; a
    worker back on the same address is found again, and requests succeed with the same
    outputs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = [o async for o in stack.frontend.generate(PROMPT_IDS, greedy, "before")][-1]
    forever = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = stack.frontend.generate(PROMPT_IDS, forever, "doomed")
    first = await asyncio.wait_for(anext(stream), TIMEOUT_S)
    assert not first.finished
    port = stack.worker.port
    await stack.worker.stop(0)
    with pytest.raises(EngineUnavailableError, match="workers failed"):
        await asyncio.wait_for(_drain(stream), TIMEOUT_S)
    await _wait_status(stack.scheduler.address, health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(EngineUnavailableError, match="workers"):
        early = stack.frontend.generate(PROMPT_IDS, greedy, "early")
        await asyncio.wait_for(_drain(early), TIMEOUT_S)
    args = EngineArgs(model=str(model_dir("llama")), **ENGINE)
    stack.worker = await start_worker_server("127.0.0.1", port)  # the fixture stops it
    await load_worker(stack.worker, args.model_config(), args.cache_config())
    await _wait_status(stack.scheduler.address, health_pb2.HealthCheckResponse.SERVING)
    # the frontend hears the engine core's health through its own watch, a moment later
    await eventually_async(lambda: stack.frontend.is_ready, "the frontend ready again")
    after = [o async for o in stack.frontend.generate(PROMPT_IDS, greedy, "after")][-1]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    stats = await stack.frontend.stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


async def test_a_worker_lost_while_idle_is_noticed_without_a_request(stack):
    await _wait_status(stack.scheduler.address, health_pb2.HealthCheckResponse.SERVING)
    await stack.worker.stop(0)
    await _wait_status(stack.scheduler.address, health_pb2.HealthCheckResponse.NOT_SERVING)


async def _drain(stream):
    async for _ in stream:
        pass
