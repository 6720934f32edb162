"""AsyncEngine: streaming (cumulative and delta), abort, consumer-gone abort, and the
event loop stays responsive while the model runs."""

import asyncio

import pytest

from pagestream import RequestOutputKind, SamplingParams
from tests.helpers.eventually import eventually, eventually_async

PROMPT = {"prompt_token_ids": [5, 17, 33, 99, 250, 12, 8, 41]}


async def _collect(engine, params, request_id=None):
    return [out async for out in engine.generate(PROMPT, params, request_id)]


async def test_cumulative_and_delta_streams_agree(engine):
    cumulative = await _collect(
        engine, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    delta_params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    deltas = await _collect(engine, delta_params)
    final = cumulative[-1].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 8
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == final.text
    assert len(cumulative) > 1  # it streamed
    assert all(not o.finished for o in cumulative[:-1]) and cumulative[-1].finished


async def test_concurrent_requests_match_sequential(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = (await _collect(engine, params))[-1].outputs[0].token_ids
    results = await asyncio.gather(*[_collect(engine, params) for _ in range(5)])
    assert all(r[-1].outputs[0].token_ids == alone for r in results)


async def test_abort_ends_the_stream_with_abort(engine):
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    seen = []

    async def consume():
        async for out in engine.generate(PROMPT, params, "to-abort"):
            seen.append(out)

    task = asyncio.create_task(consume())
    await eventually_async(lambda: len(seen) >= 2, "two outputs streamed")
    await engine.abort("to-abort")
    await asyncio.wait_for(task, timeout=30)
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert engine.engine.scheduler.kv.usage == 0.0


async def test_consumer_that_stops_iterating_aborts(engine):
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    stream = engine.generate(PROMPT, params, "walk-away")
    async for _ in stream:
        break
    await stream.aclose()
    await eventually_async(
        lambda: not engine.engine.has_unfinished_requests(), "the walked-away request aborted"
    )
    assert engine.engine.scheduler.kv.usage == 0.0


async def test_loop_is_not_blocked_by_the_forward_pass(engine, monkeypatch):
    """Each step (the forward pass) returns only once the event loop has ticked 10 times
    while it ran: a step that blocked the loop would never see a tick and fail."""
    ticks = 0
    ticks_during_steps = []
    holding = True
    core = engine.engine_core.core
    step = core.step

    def step_that_waits_for_the_loop():
        if holding:
            start = ticks
            eventually(
                lambda: ticks - start >= 10, "the event loop ticking during a step", interval=0.001
            )
            ticks_during_steps.append(ticks - start)
        return step()

    monkeypatch.setattr(core, "step", step_that_waits_for_the_loop)

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    try:
        out = await _collect(engine, SamplingParams(max_tokens=40, ignore_eos=True))
    finally:
        holding = False
        task.cancel()
    assert len(out[-1].outputs[0].token_ids) == 40
    assert ticks_during_steps  # the steps ran through the patch
    assert ticks > 10


async def test_bad_request_raises_and_engine_keeps_serving(engine):
    with pytest.raises(ValueError, match="vocabulary"):
        async for _ in engine.generate({"prompt_token_ids": [10**7]}, SamplingParams()):
            pass
    out = await _collect(engine, SamplingParams(max_tokens=3, ignore_eos=True))
    assert out[-1].outputs[0].finish_reason == "length"
