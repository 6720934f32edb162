"""DataParallelClient over stand-in engine core clients: ownership of requests (aborts
go to the owner), a lost replica ending only its own requests, and the one retry of a
request a dying replica took before producing anything."""

import asyncio

import pytest

from services.common.engine_errors import EngineUnavailableError
from services.common.engine_output import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from services.common.engine_request import EngineCoreRequest
from services.common.kv_events import KvEventBatch
from services.common.sampling_params import SamplingParams
from services.frontend.dp_engine_client import DataParallelClient
from services.frontend.router import RouterConfig

TIMEOUT = 5


class StandInClient:
    """An engine core client whose outputs and losses the test drives."""

    def __init__(self) -> None:
        self.on_ready_change = None
        self.ready = True
        self.added: list[str] = []
        self.aborted: list[str] = []
        self._batches: asyncio.Queue = asyncio.Queue()
        self.back = asyncio.Event()
        self.back.set()

    def emit(self, *outputs: EngineCoreOutput) -> None:
        self._batches.put_nowait(EngineCoreOutputs(list(outputs)))

    def lose(self) -> None:
        self.ready = False
        self.back.clear()
        self._batches.put_nowait(EngineUnavailableError("connection reset"))

    async def add_request(self, request) -> None:
        self.added.append(request.request_id)

    async def abort(self, request_ids) -> None:
        self.aborted += request_ids

    async def next_outputs(self) -> EngineCoreOutputs:
        item = await self._batches.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def reconnect(self) -> None:
        await self.back.wait()
        self.ready = True

    async def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.added))

    def release(self, request_id) -> None:
        pass

    async def watch_kv_events(self):
        yield KvEventBatch(reset=True, block_size=4)
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4))


async def _next(client: DataParallelClient) -> list[EngineCoreOutput]:
    return (await asyncio.wait_for(client.next_outputs(), TIMEOUT)).outputs


@pytest.fixture
async def pair():
    a, b = StandInClient(), StandInClient()
    client = DataParallelClient([a, b], RouterConfig(policy="round_robin"), ["a:1", "b:1"])
    yield client, a, b
    await client.close()


async def test_aborts_go_to_the_owner_and_unknown_ids_to_everyone(pair):
    client, a, b = pair
    await client.add_request(_request("x"))
    await client.add_request(_request("y"))
    assert (a.added, b.added) == (["x"], ["y"])
    await client.abort(["y"])
    assert (a.aborted, b.aborted) == ([], ["y"])
    client.release("y")
    await client.abort(["y"])  # released: nobody knows it any more, so everyone hears
    assert (a.aborted, b.aborted) == (["y"], ["y", "y"])


async def test_a_lost_replica_ends_only_its_started_requests(pair):
    client, a, b = pair
    await client.add_request(_request("x"))  # -> a
    await client.add_request(_request("y"))  # -> b
    a.emit(EngineCoreOutput("x", [7]))
    assert [o.request_id for o in await _next(client)] == ["x"]
    a.lose()
    [error] = await _next(client)
    assert (error.request_id, error.error_code) == ("x", "unavailable")
    assert "replica 0" in error.error and client.ready  # b still serves
    b.emit(EngineCoreOutput("y", [8], finish_reason="length"))
    assert [o.request_id for o in await _next(client)] == ["y"]
    await client.add_request(_request("z"))
    assert b.added == ["y", "z"]  # a is not ready: b takes the work
    a.back.set()
    for _ in range(100):
        if client.replicas[0].routable:
            break
        await asyncio.sleep(0.01)
    await client.add_request(_request("w"))
    await client.add_request(_request("v"))
    assert "w" in a.added or "v" in a.added  # routed there again once it is back


async def test_a_request_lost_before_its_first_token_is_retried_elsewhere_once(pair):
    client, a, b = pair
    await client.add_request(_request("x"))  # -> a, whose workers just died
    a.emit(EngineCoreOutput("x", [], finish_reason="error", error="gone", error_code="unavailable"))
    for _ in range(100):
        if b.added:
            break
        await asyncio.sleep(0.01)
    assert b.added == ["x"] and client.owner_of("x") == "1"
    b.emit(EngineCoreOutput("x", [], finish_reason="error", error="gone", error_code="unavailable"))
    [error] = await _next(client)  # the second loss is the client's to see
    assert (error.request_id, error.error_code) == ("x", "unavailable")


async def test_invalid_requests_are_not_retried(pair):
    client, a, b = pair
    await client.add_request(_request("x"))
    a.emit(EngineCoreOutput("x", [], finish_reason="error", error="bad", error_code=None))
    [error] = await _next(client)
    assert error.error == "bad" and b.added == []


async def test_not_ready_anywhere_refuses_at_once(pair):
    client, a, b = pair
    a.ready = b.ready = False
    assert not client.ready
    with pytest.raises(EngineUnavailableError, match="no engine replica"):
        await client.add_request(_request("x"))


async def test_engine_stats_per_replica_and_summed(pair):
    client, _a, _b = pair
    await client.add_request(_request("x"))
    per_engine = await client.engine_stats()
    assert per_engine["0"].num_running_reqs == 1 and per_engine["1"].num_running_reqs == 0
    assert (await client.stats()).num_running_reqs == 1
    assert client.routing_counts() == {("0", "round_robin"): 1}
