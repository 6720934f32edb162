"""A client that stops reading never holds up the engine or the other clients: its outputs
wait merged in its own bounded queue, and past --max-unread-tokens its request is aborted
(with the reason in the log) and its KV blocks freed. Only generous time bounds."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.frontend_config import FrontendConfig
from services.frontend.output_queue import SlowConsumerError
from tests.helpers.eventually import eventually_async
from tests.helpers.grpc_calls import PROMPT_IDS, request
from tests.helpers.servers import ENGINE, inproc_frontend, kv_idle, serving

ENGINE_ARGS = ENGINE  # for tests/conftest.py's engine
OTHERS_WITHIN_S = 30
PROMPT = {"prompt_token_ids": PROMPT_IDS}


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )


async def _complete(frontend, request_id: str, max_tokens: int) -> int:
    tokens = 0
    async for output in frontend.generate(PROMPT, _params(max_tokens), request_id):
        tokens += len(output.outputs[0].token_ids)
    return tokens


async def test_a_stalled_consumer_is_aborted_past_the_bound_and_others_finish(engine, caplog):
    frontend = inproc_frontend(engine, FrontendConfig(max_unread_tokens=16))
    try:
        stalled = frontend.generate(PROMPT, _params(200), "stalled")
        first = await asyncio.wait_for(anext(stalled), OTHERS_WITHIN_S)  # then it stops
        with caplog.at_level(logging.WARNING, logger="services.frontend.frontend"):
            others = [_complete(frontend, f"other-{i}", 32) for i in range(3)]
            done = await asyncio.wait_for(asyncio.gather(*others), OTHERS_WITHIN_S)
            assert done == [32, 32, 32]
            await eventually_async(lambda: kv_idle(frontend.stats), "stalled aborted")
        assert "request stalled: its client left" in caplog.text
        assert "max_unread_tokens=16" in caplog.text
        merged = await anext(stalled)  # what was waiting, as one output
        assert len(first.outputs[0].token_ids) + len(merged.outputs[0].token_ids) > 16
        with pytest.raises(SlowConsumerError, match="--max-unread-tokens"):
            await anext(stalled)
        assert frontend.num_live_requests() == 0
    finally:
        await frontend.close()


async def test_a_grpc_client_that_never_reads_does_not_hold_up_the_others(engine):
    async with serving(engine.frontend) as served, served.stub() as stub:
        idle_call = stub.Generate(
            request(PROMPT_IDS, temperature=0, max_tokens=200, ignore_eos=True), timeout=120
        )
        await idle_call.read()  # started; never read again

        async def other():
            message = request(PROMPT_IDS, temperature=0, max_tokens=32, ignore_eos=True)
            responses = [r async for r in stub.Generate(message, timeout=OTHERS_WITHIN_S)]
            return sum(len(r.token_ids) for r in responses)

        done = await asyncio.wait_for(asyncio.gather(*(other() for _ in range(3))), 60)
        assert done == [32, 32, 32]
        idle_call.cancel()
        await eventually_async(lambda: kv_idle(engine.frontend.stats), "everything ended")
