"""AsyncEngineCore over a batch queue of depth 1 and 2: adds and aborts between steps land,
outputs equal the reference, and an executor failure kills the loop the same way."""

import asyncio

import pytest

from services.common.backoff import Backoff
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

    monkeypatch.setattr(module, "BACKOFF", Backoff((0.0,)))
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


async def test_adds_that_arrive_during_a_step_join_the_next_one_together(build):
    """The engine-core service reads its stream ahead of the engine: the adds that arrive
    while a step runs are queued, the loop takes them all before the next step, and they
    share it (taken one at a time, each waited out a step and ran in a step of its own:
    128 embeddings, 128 steps)."""
    import time

    from services.common.convert.engine_io import engine_request_to_pb
    from services.common.proto.pagestream.internal.v1 import engine_pb2
    from services.scheduler.engine_core_service import EngineCoreServicer
    from tests.scheduler.stand_in_worker import StandInWorker

    class SlowWorker(StandInWorker):
        def execute(self, plan):
            time.sleep(0.05)  # a step long enough for the rest to arrive during it
            return super().execute(plan)

    scheduler, _ = build(64, block_size=4)
    worker = SlowWorker(64, 4)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, 1)))
    servicer = EngineCoreServicer(core, info=None)
    client = core.connect()
    rids = [f"r{i}" for i in range(8)]

    async def stream():
        for i, rid in enumerate(rids):
            add = engine_request_to_pb(_request(rid, [i + 1, i + 2, i + 3], 2))
            yield engine_pb2.EngineRequest(add=add)
            # a stream read suspends (as gRPC's does); after the first, its step starts
            await asyncio.sleep(0.01 if i == 0 else 0)

    out: asyncio.Queue = asyncio.Queue()
    reader = asyncio.create_task(servicer._read_requests(client, stream(), out))
    results = await _drain(core, client, set(rids))
    await asyncio.wait_for(reader, TIMEOUT_S)
    await core.shutdown()
    admitted = [len(p.scheduled_new_reqs) for p in worker.plans if p.scheduled_new_reqs]
    assert admitted == [1, 7], admitted
    assert all(reason == "length" for _, reason in results.values())


async def test_queued_adds_and_aborts_keep_their_order_and_refusals_reach_the_client(build):
    scheduler, worker = build(40, block_size=4, max_model_len=16)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, 1)))
    client = core.connect()
    core.queue_add(client, _request("kept", [1, 2, 3], 4))
    core.queue_add(client, _request("aborted", [4, 5, 6], 4))
    core.queue_abort(client, ["aborted"])  # taken with its add, after it
    core.queue_add(client, _request("too-long", list(range(20)), 4))
    errors = {}

    async def note_error(out):
        errors[out.request_id] = out.error

    results = await _drain(core, client, {"kept", "aborted", "too-long"}, note_error)
    await core.shutdown()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert results["kept"] == (reference_generate([1, 2, 3], params, 160), "length")
    assert results["aborted"][1] == "abort"
    assert results["too-long"] == ([], "error") and "max_model_len" in errors["too-long"]
    assert scheduler.kv.num_free_blocks == 40


async def test_the_adds_a_client_queued_before_it_went_away_are_dropped(build):
    scheduler, worker = build(40, block_size=4)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, 1)))
    gone, stays = core.connect(), core.connect()
    core.queue_add(gone, _request("orphan", [1, 2, 3], 4))
    await core.disconnect(gone)  # before the loop took its add
    core.queue_add(stays, _request("r0", [4, 5, 6], 4))
    results = await _drain(core, stays, {"r0"})
    await core.shutdown()
    assert results["r0"][1] == "length"
    assert [r.request_id for p in worker.plans for r in p.scheduled_new_reqs] == ["r0"]


async def test_shutdown_right_after_an_add_or_abort_ends_the_loop(build):
    """An add or abort wakes the idle loop; a shutdown in the same turn used to be lost
    (asyncio.wait_for before Python 3.12 swallows a cancellation that lands as the event
    it waits for is set), leaving the loop running and shutdown() waiting for ever: the
    engine-core server's stop with a stream open hung so."""
    scheduler, worker = build(40, block_size=4)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, 1)))
    client = core.connect()
    for _ in range(3):
        await asyncio.sleep(0)  # the loop starts and waits, idle
    core.queue_abort(client, ["nothing"])
    stopping = asyncio.create_task(core.shutdown())
    await asyncio.wait([stopping], timeout=TIMEOUT_S)  # (wait_for would hide the hang)
    ignored = not stopping.done()
    if ignored:
        core._task.cancel()  # a second cancel ends it
        await stopping
    assert not ignored, "the loop ignored shutdown()'s cancel"
    assert core._task.cancelled()


async def test_queued_adds_while_the_workers_are_away_are_refused_as_unavailable(build):
    import threading

    scheduler, worker = build(40, block_size=4)
    fresh_scheduler, fresh_worker = build(40, block_size=4)
    back = threading.Event()

    def rebuild():
        back.wait(TIMEOUT_S)
        return EngineCore(fresh_scheduler, UniExecutor(fresh_worker, 1))

    executor = StandInExecutor(worker, 1, fail_at_plan=0)
    core = AsyncEngineCore(EngineCore(scheduler, executor), rebuild=rebuild, max_rebuilds=1)
    readiness: asyncio.Queue = asyncio.Queue()

    async def on_ready(ready):
        readiness.put_nowait(ready)

    core.on_ready = on_ready
    client = core.connect()
    core.queue_add(client, _request("lost", list(range(9)), 4))
    assert await asyncio.wait_for(readiness.get(), TIMEOUT_S) is False
    core.queue_add(client, _request("refused", [1, 2, 3], 4))
    back.set()
    assert await asyncio.wait_for(readiness.get(), TIMEOUT_S) is True
    core.queue_add(client, _request("served", [1, 2, 3], 4))
    codes = {}

    async def note_error(out):
        if out.finish_reason == "error":
            codes[out.request_id] = out.error_code

    results = await _drain(core, client, {"lost", "refused", "served"}, note_error)
    await core.shutdown()
    assert codes == {"lost": "unavailable", "refused": "unavailable"}
    assert results["served"][1] == "length"


async def test_a_queued_abort_ends_only_the_aborting_clients_own_requests(build):
    """Request ids are one namespace across frontends: a frontend whose add of "shared" was
    refused (the id was in use by another frontend's request) and whose caller then went
    away aborts "shared"; that must not end the other frontend's request."""
    scheduler, worker = build(40, block_size=4)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, 1)))
    owner, other = core.connect(), core.connect()
    core.queue_add(owner, _request("shared", [1, 2, 3], 4))
    core.queue_add(other, _request("shared", [4, 5, 6], 4))  # refused: the id is in use
    core.queue_abort(other, ["shared"])  # its caller went away before the refusal came
    refused = await _drain(core, other, {"shared"})
    results = await _drain(core, owner, {"shared"})
    await core.shutdown()
    assert refused["shared"] == ([], "error")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert results["shared"] == (reference_generate([1, 2, 3], params, 160), "length")


async def test_an_add_that_fails_by_the_engines_fault_is_an_internal_error(build):
    """A bug admitting a request fails that request alone, as the engine's fault
    (error_code "internal": HTTP 500 / gRPC INTERNAL), not as a bad request (400)."""
    scheduler, worker = build(40, block_size=4)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, 1)))
    client = core.connect()

    def broken(request):
        raise KeyError("a bug")

    real_add = scheduler.add_request
    scheduler.add_request = broken
    core.queue_add(client, _request("hit", [1, 2, 3], 4))
    batch = await asyncio.wait_for(core.outputs(client), TIMEOUT_S)
    scheduler.add_request = real_add
    core.queue_add(client, _request("after", [1, 2, 3], 4))
    results = await _drain(core, client, {"after"})
    await core.shutdown()
    [output] = batch.outputs
    assert (output.request_id, output.finish_reason) == ("hit", "error")
    assert output.error_code == "internal" and "a bug" in output.error
    assert results["after"][1] == "length"


async def test_the_waiting_bound_holds_for_adds_taken_together(build):
    """30 adds taken in one go, under max_waiting_requests=4: four wait and run, and each
    of the other 26 is refused as overloaded (RESOURCE_EXHAUSTED / HTTP 429)."""
    scheduler, worker = build(80, block_size=4, max_num_seqs=2, max_waiting_requests=4)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, 1)))
    client = core.connect()
    rids = [f"r{i}" for i in range(30)]
    for i, rid in enumerate(rids):
        core.queue_add(client, _request(rid, [1, 2, 3, i], 5))
    codes = {}

    async def note_code(out):
        codes[out.request_id] = out.error_code

    results = await _drain(core, client, set(rids), note_code)
    await core.shutdown()
    assert [rid for rid in rids if results[rid][1] == "length"] == rids[:4]
    assert {codes[rid] for rid in rids[4:]} == {"resource_exhausted"}
    assert scheduler.kv.num_free_blocks == 80


async def test_an_id_aborted_and_added_again_in_one_take_ends_then_runs_anew(build):
    """The abort's final output reaches the client before any output of the new request
    of the same id, and the new one runs in full (a step of the old one may be in flight)."""
    scheduler, worker = build(40, block_size=4)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker, 2)))
    client = core.connect()
    core.queue_add(client, _request("x", [1, 2, 3], 50))
    seen = []
    while len(seen) < 3:  # the first request is running
        batch = await asyncio.wait_for(core.outputs(client), TIMEOUT_S)
        seen += [(o.new_token_ids, o.finish_reason) for o in batch.outputs]
    core.queue_abort(client, ["x"])
    core.queue_add(client, _request("x", [4, 5, 6], 4))
    after = []
    while not after or after[-1][1] != "length":
        batch = await asyncio.wait_for(core.outputs(client), TIMEOUT_S)
        after += [(o.new_token_ids, o.finish_reason) for o in batch.outputs]
    await core.shutdown()
    reasons = [reason for _, reason in after]
    assert reasons.count("abort") == 1 and after[reasons.index("abort")][0] == []
    # before the abort: old tokens the client had not read yet; after it: the new request
    new = [t for tokens, _ in after[reasons.index("abort") + 1 :] for t in tokens]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert new == reference_generate([4, 5, 6], params, 160)
    assert scheduler.kv.num_free_blocks == 40
