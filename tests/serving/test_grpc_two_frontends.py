"""Two frontends share one scheduler: both are served, and one frontend going away (a
restart) aborts only its own requests while the other's stream on undisturbed."""

import asyncio

import pytest

from pagestream.engine_args import EngineArgs
from services.common.sampling_params import SamplingParams
from services.frontend.frontend import Frontend
from services.frontend.grpc_engine_client import GrpcEngineCoreClient
from services.frontend.tokenizer import load_tokenizer
from services.scheduler.engine_core_service import serve_scheduler
from services.worker.worker_service import serve_worker
from tests.helpers.eventually import eventually_async

TIMEOUT_S = 60
PROMPT = {"prompt_token_ids": [5, 17, 33, 99, 250, 12, 8, 41]}


async def _frontend(address, tokenizer) -> Frontend:
    client = await GrpcEngineCoreClient.connect(address, timeout_s=TIMEOUT_S)
    return Frontend(client, tokenizer, await client.get_engine_info())


async def _last(frontend, params, request_id):
    outputs = [o async for o in frontend.generate(PROMPT, params, request_id)]
    return outputs[-1].outputs[0]


@pytest.fixture
async def scheduler(model_dir):
    args = EngineArgs(model=str(model_dir("llama")), kv_cache_memory="8MiB", swap_space=0.01)
    worker = await serve_worker(args.model_config(), args.cache_config())
    server = await serve_scheduler(worker.address, args, worker_timeout_s=TIMEOUT_S)
    yield server
    await server.stop(0)
    await worker.stop(0)


async def test_a_frontend_restart_leaves_the_other_undisturbed(scheduler, model_dir):
    tokenizer = load_tokenizer(model_dir("llama"))
    first = await _frontend(scheduler.address, tokenizer)
    second = await _frontend(scheduler.address, tokenizer)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = await asyncio.wait_for(_last(first, greedy, "warm-up"), TIMEOUT_S)

    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    survivor = asyncio.ensure_future(_last(second, long, "survivor"))
    doomed_stream = first.generate(PROMPT, SamplingParams(max_tokens=10_000, ignore_eos=True))
    await asyncio.wait_for(doomed_stream.__anext__(), TIMEOUT_S)  # it is running
    await first.close()  # the first frontend goes away mid-stream
    restarted = await _frontend(scheduler.address, tokenizer)
    again = await asyncio.wait_for(_last(restarted, greedy, "after-restart"), TIMEOUT_S)
    result = await asyncio.wait_for(survivor, TIMEOUT_S)

    assert result.finish_reason == "length" and len(result.token_ids) == 40
    assert result.token_ids[:12] == alone.token_ids  # greedy: the same start
    assert again.token_ids == alone.token_ids

    async def freed():  # the doomed request was aborted: its blocks came back
        stats = await restarted.stats()
        return stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0

    await eventually_async(freed, "the doomed request aborted and its blocks freed")
    await second.close()
    await restarted.close()
