"""The Frontend over a scripted EngineCoreClient: a lost connection fails every stream and
turns readiness off; requests meanwhile are refused at once; once the client reconnects
it serves again; a client that can never come back leaves the frontend dead (not alive).
Also the server-side request timeout, slow consumers and overload errors, without a model."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.common.engine_errors import EngineOverloadedError, EngineUnavailableError
from services.common.engine_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.common.served_model_info import ServedModelInfo
from services.frontend.frontend import Frontend, RequestTimeoutError
from services.frontend.frontend_config import FrontendConfig
from services.frontend.output_queue import SlowConsumerError
from tests.helpers.eventually import eventually_async

INFO = ServedModelInfo("fake", max_model_len=64, vocab_size=100, eos_token_ids=(2,))
PROMPT = {"prompt_token_ids": [5, 6, 7]}
TIMEOUT = 5


class ScriptedClient:
    """An EngineCoreClient whose outputs, losses and readiness the test drives."""

    def __init__(self) -> None:
        self.on_ready_change = None
        self._ready = True
        self.batches: asyncio.Queue = asyncio.Queue()
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.released: list[str] = []  # requests the Frontend is done with
        self.back = asyncio.Event()
        self.back.set()
        self.gone_for_good = False
        self.num_reconnects = 0

    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self, ready: bool) -> None:
        self._ready = ready
        if self.on_ready_change is not None:
            self.on_ready_change(ready)

    def emit(self, *outputs: EngineCoreOutput) -> None:
        self.batches.put_nowait(EngineCoreOutputs(list(outputs)))

    def lose(self, error: Exception) -> None:
        self.batches.put_nowait(error)

    async def reconnect(self) -> None:
        self.num_reconnects += 1
        if self.gone_for_good:
            raise EngineUnavailableError("the engine loop died")
        await self.back.wait()

    async def add_request(self, request) -> None:
        self.added.append(request.request_id)

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def next_outputs(self) -> EngineCoreOutputs:
        item = await self.batches.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def stats(self) -> SchedulerStats:
        return SchedulerStats()

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    async def close(self) -> None:
        pass


@pytest.fixture
async def setup():
    client = ScriptedClient()
    frontend = Frontend(client, None, INFO)
    events: list[bool] = []
    frontend.add_readiness_listener(events.append)
    yield client, frontend, events
    await frontend.close()


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA, **kwargs)


async def test_a_lost_engine_core_fails_streams_refuses_new_work_and_recovers(setup):
    client, frontend, events = setup
    stream = frontend.generate(PROMPT, _params(), "a")
    pending = asyncio.ensure_future(anext(stream))
    await eventually_async(lambda: client.added == ["a"])
    client.emit(EngineCoreOutput("a", [11]))
    assert (await asyncio.wait_for(pending, TIMEOUT)).outputs[0].token_ids == [11]
    client.back.clear()
    client.lose(EngineUnavailableError("stream broke"))
    with pytest.raises(EngineUnavailableError, match="stream broke"):
        await asyncio.wait_for(anext(stream), TIMEOUT)
    await eventually_async(lambda: not frontend.is_ready)
    assert frontend.is_alive and events == [False]
    assert client.released == ["a"]  # the ended stream let go of its request
    with pytest.raises(EngineUnavailableError, match="reconnecting"):
        await anext(frontend.generate(PROMPT, _params(), "refused"))
    assert client.added == ["a"]  # never sent
    client.back.set()
    await eventually_async(lambda: frontend.is_ready)
    assert events == [False, True]
    again = frontend.generate(PROMPT, _params(), "b")
    pending = asyncio.ensure_future(anext(again))
    await eventually_async(lambda: "b" in client.added)
    client.emit(EngineCoreOutput("b", [12], finish_reason="length"))
    assert (await asyncio.wait_for(pending, TIMEOUT)).finished


async def test_an_engine_core_that_is_not_ready_refuses_at_once(setup):
    client, frontend, events = setup
    client.set_ready(False)
    assert not frontend.is_ready and frontend.is_alive and events == [False]
    with pytest.raises(EngineUnavailableError, match="workers are away"):
        await anext(frontend.generate(PROMPT, _params()))
    client.set_ready(True)
    assert frontend.is_ready and events == [False, True]


async def test_an_engine_core_that_can_never_come_back_leaves_the_frontend_dead(setup):
    client, frontend, events = setup
    client.gone_for_good = True
    client.lose(EngineUnavailableError("loop failed"))
    await eventually_async(lambda: not frontend.is_alive)
    assert not frontend.is_ready and events == [False]
    with pytest.raises(EngineUnavailableError, match="loop died"):
        await anext(frontend.generate(PROMPT, _params()))


async def test_outputs_with_error_codes_become_the_matching_exceptions(setup):
    client, frontend, _ = setup
    for code, error in (
        ("resource_exhausted", EngineOverloadedError),
        ("unavailable", EngineUnavailableError),
        (None, ValueError),
    ):
        stream = frontend.generate(PROMPT, _params(), f"r-{code}")
        pending = asyncio.ensure_future(anext(stream))
        await eventually_async(lambda code=code: f"r-{code}" in client.added)
        client.emit(EngineCoreOutput(f"r-{code}", [], "error", error="no", error_code=code))
        with pytest.raises(error):
            await asyncio.wait_for(pending, TIMEOUT)
    assert frontend.num_live_requests() == 0


async def test_the_request_timeout_aborts_the_request():
    client = ScriptedClient()
    frontend = Frontend(client, None, INFO, config=FrontendConfig(request_timeout_s=0.2))
    try:
        stream = frontend.generate(PROMPT, _params(), "slow")
        pending = asyncio.ensure_future(anext(stream))
        await eventually_async(lambda: client.added == ["slow"])
        client.emit(EngineCoreOutput("slow", [11]))
        await asyncio.wait_for(pending, TIMEOUT)
        with pytest.raises(RequestTimeoutError, match="--request-timeout"):
            await asyncio.wait_for(anext(stream), TIMEOUT)
        await eventually_async(lambda: client.aborted == ["slow"])
        assert frontend.num_live_requests() == 0
    finally:
        await frontend.close()


async def test_a_consumer_that_stops_reading_is_aborted_past_the_bound(caplog):
    client = ScriptedClient()
    frontend = Frontend(client, None, INFO, config=FrontendConfig(max_unread_tokens=5))
    try:
        stalled = frontend.generate(PROMPT, _params(), "stalled")
        first = asyncio.ensure_future(anext(stalled))
        read: list[int] = []

        async def read_all():
            async for output in frontend.generate(PROMPT, _params(), "reader"):
                read.extend(output.outputs[0].token_ids)

        reader = asyncio.ensure_future(read_all())
        await eventually_async(lambda: client.added == ["stalled", "reader"])
        with caplog.at_level(logging.WARNING, logger="services.frontend.frontend"):
            for step in range(8):  # the stalled consumer never reads after its first output
                client.emit(
                    EngineCoreOutput("stalled", [10 + step]), EngineCoreOutput("reader", [step])
                )
                await eventually_async(lambda step=step: len(read) == step + 1)
            await eventually_async(lambda: "stalled" in client.aborted)
        assert "left 6 tokens unread" in caplog.text and "request stalled" in caplog.text
        await asyncio.wait_for(first, TIMEOUT)
        merged = await asyncio.wait_for(anext(stalled), TIMEOUT)  # what it had, merged
        assert merged.outputs[0].token_ids == [11, 12, 13, 14, 15, 16]
        with pytest.raises(SlowConsumerError):
            await asyncio.wait_for(anext(stalled), TIMEOUT)
        client.emit(EngineCoreOutput("reader", [8], finish_reason="length"))
        await asyncio.wait_for(reader, TIMEOUT)
        assert read == list(range(9)) and client.aborted == ["stalled"]
    finally:
        await frontend.close()


async def _abandon(client: ScriptedClient, frontend: Frontend, request_id: str) -> None:
    """A request whose consumer reads one output, then goes away (the frontend aborts it)."""
    stream = frontend.generate(PROMPT, _params(), request_id)
    first = asyncio.ensure_future(anext(stream))
    await eventually_async(lambda: client.added == [request_id])
    client.emit(EngineCoreOutput(request_id, [11]))
    await asyncio.wait_for(first, TIMEOUT)
    await stream.aclose()
    await eventually_async(lambda: client.aborted == [request_id])


async def test_an_abandoned_id_stays_in_use_until_its_abort_lands():
    """A consumer that stops early aborts its request; a request re-added under the same id
    before the engine core's final output for the abort is refused (that abort would end
    it), and is served once the abort has landed."""
    client = ScriptedClient()
    frontend = Frontend(client, None, INFO)
    try:
        await _abandon(client, frontend, "r")
        with pytest.raises(ValueError, match="'r' is already in use"):
            await asyncio.wait_for(anext(frontend.generate(PROMPT, _params(), "r")), TIMEOUT)
        assert client.added == ["r"] and "r" not in client.released
        client.emit(EngineCoreOutput("r", [12], "abort"))  # the abort lands
        await eventually_async(lambda: client.released == ["r"])
        again = frontend.generate(PROMPT, _params(), "r")
        pending = asyncio.ensure_future(anext(again))
        await eventually_async(lambda: client.added == ["r", "r"])
        client.emit(EngineCoreOutput("r", [13], "length"))
        output = await asyncio.wait_for(pending, TIMEOUT)
        assert output.finished and output.outputs[0].token_ids == [13]
        assert client.aborted == ["r"]
    finally:
        await frontend.close()


async def test_abandoned_ids_are_freed_when_the_engine_core_is_lost():
    client = ScriptedClient()
    frontend = Frontend(client, None, INFO)
    try:
        await _abandon(client, frontend, "r")
        client.lose(EngineUnavailableError("gone"))  # the abort is never answered
        await eventually_async(lambda: client.released == ["r"])
        await eventually_async(lambda: frontend.is_ready)
        assert "r" not in frontend.output_processor.states
    finally:
        await frontend.close()
