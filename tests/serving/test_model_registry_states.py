"""ModelRegistry's state machine over a fake loader (no processes): loads on first use,
one load per model however many wait, failures that stick, --models-max LRU eviction that
never takes a busy or pinned model, keep_alive, idle unload and the memory rule."""

from __future__ import annotations

import asyncio

import pytest

from pagestream.engine_args import EngineArgs
from pagestream.models.keep_alive import FOREVER, parse_keep_alive
from pagestream.models.memory_estimate import GIB, Footprint
from pagestream.models.model_entry import ModelState
from pagestream.models.model_errors import ModelLoadFailedError, ModelMemoryError, ModelsBusyError
from pagestream.models.model_registry import ModelRegistry
from pagestream.models.model_spec import ModelSpec
from pagestream.models.models_config import ModelsConfig
from services.frontend.openai.exceptions import ModelNotFoundError
from tests.helpers.eventually import eventually_async


class FakeModel:
    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False

    async def close(self) -> None:
        self.closed = True


class FakeLoader:
    """Loads succeed, except the names in `broken`; a name in `gates` waits for its event."""

    def __init__(self, broken=()) -> None:
        self.loads: list[str] = []
        self.broken = set(broken)
        self.gates: dict[str, asyncio.Event] = {}
        self.models: list[FakeModel] = []

    async def __call__(self, spec: ModelSpec) -> FakeModel:
        self.loads.append(spec.name)
        if spec.name in self.gates:
            await self.gates[spec.name].wait()
        if spec.name in self.broken:
            raise ValueError(f"{spec.name}: config.json is not JSON")
        self.models.append(FakeModel(spec.name))
        return self.models[-1]


def _registry(names=("a", "b", "c"), pinned=(), loader=None, sizes=None, **config):
    specs = [ModelSpec(n, EngineArgs(model=f"/m/{n}"), n in pinned) for n in names]
    sizes = sizes or {}
    return ModelRegistry(
        specs,
        loader or FakeLoader(),
        ModelsConfig(**config),
        available=lambda: None,
        measure=lambda s: Footprint(sizes.get(s.name, 0), 0),
    )


def _state(registry, name):
    return registry.entries[name].state


async def test_first_use_loads_once_while_requests_wait():
    loader = FakeLoader()
    loader.gates["a"] = asyncio.Event()
    registry = _registry(loader=loader)
    waiting = [asyncio.ensure_future(registry.acquire("a")) for _ in range(3)]
    await eventually_async(lambda: loader.loads == ["a"])
    assert _state(registry, "a") is ModelState.LOADING
    assert registry.entries["a"].users == 3
    loader.gates["a"].set()
    leases = await asyncio.gather(*waiting)
    assert loader.loads == ["a"] and _state(registry, "a") is ModelState.LOADED
    assert {id(lease.model) for lease in leases} == {id(loader.models[0])}
    for lease in leases:
        lease.release()
    assert registry.entries["a"].users == 0


async def test_the_default_model_and_an_unknown_one():
    registry = _registry()
    lease = await registry.acquire(None)
    assert lease.model.name == "a"  # the first spec is the default
    lease.release()
    with pytest.raises(ModelNotFoundError, match="`zzz`"):
        await registry.acquire("zzz")


async def test_a_failed_load_sticks_with_its_error_while_the_others_serve():
    loader = FakeLoader(broken={"b"})
    registry = _registry(loader=loader)
    with pytest.raises(ModelLoadFailedError, match=r"model `b` failed to load: b: config\.json"):
        await registry.acquire("b")
    assert _state(registry, "b") is ModelState.FAILED
    assert registry.entries["b"].status() == {
        "value": "failed",
        "failed": True,
        "error": "b: config.json is not JSON",
    }
    with pytest.raises(ModelLoadFailedError):  # no new load per request
        await registry.acquire("b")
    assert loader.loads == ["b"]
    (await registry.acquire("a")).release()
    loader.broken.clear()
    await registry.load("b")  # an explicit load tries again
    assert _state(registry, "b") is ModelState.LOADED and registry.entries["b"].error is None


async def test_models_max_evicts_the_least_recently_used_idle_model():
    loader = FakeLoader()
    registry = _registry(loader=loader, models_max=2)
    for name in ("a", "b"):
        (await registry.acquire(name)).release()
    (await registry.acquire("a")).release()  # b is now the least recently used
    (await registry.acquire("c")).release()
    assert [_state(registry, n) for n in "abc"] == ["loaded", "unloaded", "loaded"]
    assert [m.closed for m in loader.models] == [False, True, False]


async def test_a_busy_model_is_never_evicted_the_load_waits_for_it():
    registry = _registry(models_max=1)
    held = await registry.acquire("a")
    waiting = asyncio.ensure_future(registry.acquire("b"))
    await eventually_async(lambda: registry.entries["b"].users == 1)
    await asyncio.sleep(0.05)
    assert not waiting.done() and _state(registry, "a") is ModelState.LOADED
    held.release()
    lease = await waiting
    assert _state(registry, "a") is ModelState.UNLOADED and lease.model.name == "b"
    lease.release()


async def test_alternating_traffic_under_models_max_1_loses_no_request():
    registry = _registry(models_max=1)

    async def request(name):
        lease = await registry.acquire(name)
        try:
            await asyncio.sleep(0)
            return lease.model.name
        finally:
            lease.release()

    names = ["a", "b"] * 6
    assert await asyncio.gather(*(request(n) for n in names)) == names


async def test_all_busy_past_the_wait_is_a_busy_refusal():
    registry = _registry(models_max=1)
    registry.slot_wait_s = 0.05
    held = await registry.acquire("a")
    with pytest.raises(ModelsBusyError, match=r"model `b`: all 1 loaded models are busy"):
        await registry.acquire("b")
    assert _state(registry, "b") is ModelState.UNLOADED
    assert registry.entries["b"].users == 0
    held.release()


async def test_a_pinned_model_is_never_evicted_nor_unloaded():
    registry = _registry(pinned={"a"}, models_max=1)
    registry.slot_wait_s = 0.05
    registry.start()
    await eventually_async(lambda: _state(registry, "a") is ModelState.LOADED)
    with pytest.raises(ModelsBusyError):
        await registry.acquire("b")
    with pytest.raises(ValueError, match="pinned"):
        await registry.unload("a")
    await registry.close()
    assert _state(registry, "a") is ModelState.UNLOADED  # the server's end unloads it


async def test_keep_alive_zero_unloads_once_the_requests_end():
    loader = FakeLoader()
    registry = _registry(loader=loader)
    first, second = await registry.acquire("a"), await registry.acquire("a", keep_alive=0.0)
    second.release()
    await asyncio.sleep(0.05)
    assert _state(registry, "a") is ModelState.LOADED  # one request still holds it
    first.release()
    await eventually_async(lambda: _state(registry, "a") is ModelState.UNLOADED)
    assert loader.models[0].closed


async def test_idle_unload_and_a_keep_alive_that_keeps_it():
    registry = _registry(idle_unload_seconds=0.2)
    registry.start()
    (await registry.acquire("a")).release()
    (await registry.acquire("b", keep_alive=FOREVER)).release()
    await eventually_async(lambda: _state(registry, "a") is ModelState.UNLOADED)
    assert _state(registry, "b") is ModelState.LOADED
    await registry.close()


async def test_explicit_unload_waits_for_requests_in_flight():
    registry = _registry()
    lease = await registry.acquire("a")
    await registry.unload("a")
    assert _state(registry, "a") is ModelState.LOADED
    lease.release()
    await eventually_async(lambda: _state(registry, "a") is ModelState.UNLOADED)


async def test_memory_evicts_idle_models_first_then_refuses_naming_both_figures():
    sizes = {"a": 3 * GIB, "b": 3 * GIB, "c": 5 * GIB}
    registry = _registry(sizes=sizes, models_memory="6GiB", models_max=0)
    for name in ("a", "b"):
        (await registry.acquire(name)).release()
    lease = await registry.acquire("a")  # b idle and least recently used: it goes
    assert [_state(registry, n) for n in "ab"] == ["loaded", "loaded"]
    with pytest.raises(ModelMemoryError) as refused:
        await registry.acquire("c")  # b goes, a is busy: 3 GiB left for 5
    assert "needs 5.00 GiB (weights 5.00 GiB + KV cache 0.00 GiB)" in str(refused.value)
    assert "3.00 GiB is left of --models-memory" in str(refused.value)
    assert _state(registry, "b") is ModelState.UNLOADED
    assert _state(registry, "c") is ModelState.UNLOADED and registry.entries["c"].error
    lease.release()
    (await registry.acquire("c")).release()  # a idle now: evicted for c
    assert _state(registry, "a") is ModelState.UNLOADED


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (30, 30.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("-1", FOREVER),
        (-5, FOREVER),
        ("45", 45.0),
    ],
)
def test_keep_alive_values(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["5 minutes", "m", True, [1], "1" * 40, "nan", {"a": 1}])
def test_bad_keep_alive_values_name_the_field(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)
