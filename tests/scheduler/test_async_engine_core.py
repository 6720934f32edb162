"""AsyncEngineCore over a batch queue of depth 1 and 2: adds and aborts between steps land,
outputs equal the reference, and an executor failure kills the loop the same way."""

import asyncio

import pytest

from services.common.engine_request import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.scheduler.async_engine_core import AsyncEngineCore, EngineDeadError
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor.uni import UniExecutor
from tests.scheduler.stand_in_executor import StandInExecutor
from tests.scheduler.stand_in_worker import EOS_TOKEN_ID, reference_generate

DEPTHS = pytest.mark.parametrize("depth", [1, 2])
TIMEOUT_S = 30  # a safety net against hangs, never a timing assertion


def _request(rid: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(rid, prompt, params, eos_token_id=EOS_TOKEN_ID)


async def _drain(core: AsyncEngineCore, client: int, rids: set[str], on_output=None) -> dict:
    """Outputs per request id until every one in rids has finished: (tokens, reason)."""
    results = {rid: ([], None) for rid in rids}
    while any(reason is None for _, reason in results.values()):
        batch = await asyncio.wait_for(core.outputs(client), TIMEOUT_S)
        for out in batch.outputs:
            tokens, _ = results[out.request_id]
            results[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
            if on_output is not None:
                await on_output(out)
    return results


@DEPTHS
async def test_adds_and_aborts_between_steps(build, depth):
    scheduler, worker = build(40, block_size=4, max_num_batched_tokens=12)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, depth)))
    client = core.connect()
    prompts = {f"r{i}": list(range(10 * i, 10 * i + 5 + 3 * i)) for i in range(4)}
    for rid, prompt in prompts.items():
        await core.add_request(client, _request(rid, prompt, 10))

    async def react(out):
        if out.request_id == "r0" and not reacted:
            reacted.append(out)
            await core.abort(["r1"])  # r1 may well have a step in flight now
            await core.add_request(client, _request("late", [7, 7, 7], 6))

    reacted = []

    results = await _drain(core, client, {*prompts, "late"}, react)
    assert results["r1"][1] == "abort"
    for rid, (tokens, reason) in results.items():
        if rid == "r1":
            continue
        prompt = prompts.get(rid, [7, 7, 7])
        params = SamplingParams(max_tokens=6 if rid == "late" else 10, ignore_eos=True)
        assert (tokens, reason) == (reference_generate(prompt, params, 160), "length")
    await core.shutdown()
    assert scheduler.kv.num_free_blocks == 40 and not scheduler.in_flight.groups


@DEPTHS
async def test_a_failed_step_kills_the_loop(build, depth):
    scheduler, worker = build(40, block_size=4, max_num_batched_tokens=8)
    executor = StandInExecutor(worker, depth, fail_at_plan=3)
    core = AsyncEngineCore(EngineCore(scheduler, executor))
    client = core.connect()
    for i in range(3):
        await core.add_request(client, _request(f"r{i}", list(range(i, i + 9)), 20))
    with pytest.raises(EngineDeadError, match="stand-in worker gone at plan 3"):
        await _drain(core, client, {"r0", "r1", "r2"})
    assert isinstance(core.dead_error, ConnectionError)
    with pytest.raises(EngineDeadError):
        await core.add_request(client, _request("after", [1, 2], 2))
    await core.shutdown()


async def test_rebuilds_that_keep_failing_end_the_loop_after_max_rebuilds(build, monkeypatch):
    """A lost worker group of the engine's own is started again a bounded number of times;
    then the loop dies (the role exits and its starter's give-up rule applies)."""
    import services.scheduler.async_engine_core as module

    monkeypatch.setattr(module, "BACKOFF_S", (0.0,))
    scheduler, worker = build(40, block_size=4, max_num_batched_tokens=8)
    attempts = []

    def rebuild():
        attempts.append(len(attempts))
        raise ConnectionError(f"the group did not come back (attempt {len(attempts)})")

    executor = StandInExecutor(worker, 1, fail_at_plan=1)
    core = AsyncEngineCore(EngineCore(scheduler, executor), rebuild=rebuild, max_rebuilds=2)
    client = core.connect()
    await core.add_request(client, _request("r0", list(range(9)), 20))
    reasons = []
    while "error" not in reasons:  # the loss ends r0 with an error
        batch = await asyncio.wait_for(core.outputs(client), TIMEOUT_S)
        reasons += [o.finish_reason for o in batch.outputs if o.finish_reason is not None]
    assert reasons == ["error"]
    with pytest.raises(EngineDeadError, match=r"attempt 2"):
        await asyncio.wait_for(core.outputs(client), TIMEOUT_S)
    assert attempts == [0, 1]
    await core.shutdown()
