"""Many models behind one server (pagestream/models/): a models directory of two tiny
random models and a broken folder, served by the real dispatcher and engine-core processes
(one server for the module; loads are few: each costs seconds on two cores), called with the
official openai client and plain HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import re

import openai
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from pagestream.cli import build_parser
from pagestream.models.models_serve import start_models_server
from tests.helpers.eventually import eventually_async
from tests.helpers.processes import alive

try:  # recent openai clients ship httpx as "httpx2"
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "models-key"
TIMEOUT = 600.0  # a first load may compile the C++ kernels (minutes on 2 cores)
PROMPT = [5, 17, 42, 9, 33, 61, 7]
MAX_TOKENS = 6
FAMILIES = {"llama": "llama", "qwen": "qwen2"}  # served name -> tiny model family


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for name, family in FAMILIES.items():
        (root / name).symlink_to(model_dir(family))
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    argv = ["serve", "--models-dir", str(root), "--port", "0", "--grpc-port", "0", "--api-key", KEY]
    argv += ["--kv-cache-memory", "8MiB", "--swap-space", "0.01", "--models-max", "2"]
    server = await start_models_server(build_parser().parse_args(argv))
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(5.0), TIMEOUT)


@pytest.fixture(scope="module")
def expected(model_dir, hf_greedy):
    """name -> HF float32 greedy text of PROMPT."""
    texts = {}
    for name, family in FAMILIES.items():
        folder = model_dir(family)
        ids = hf_greedy(folder, PROMPT, MAX_TOKENS)
        texts[name] = AutoTokenizer.from_pretrained(folder).decode(ids, skip_special_tokens=True)
    return texts


def _client(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{served.http.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT
    )


def _http(served, key: str | None = KEY) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=served.http.url, headers=headers, timeout=TIMEOUT)


async def _complete(client, model: str, **extra) -> str:
    reply = await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
    )
    return reply.choices[0].text


async def _statuses(served) -> dict[str, dict]:
    async with _http(served) as http:
        reply = await http.get("/v1/models")
    assert reply.status_code == 200
    return {card["id"]: card["status"] for card in reply.json()["data"]}


def _entry(served, name):
    return served.registry.entries[name]


async def test_every_model_listed_unloaded_and_the_client_parses_the_list(served):
    client = _client(served)
    listed = await client.models.list()
    assert sorted(m.id for m in listed.data) == ["broken", "llama", "qwen"]
    assert all(status == {"value": "unloaded"} for status in (await _statuses(served)).values())
    await client.close()


async def test_without_the_key_nothing_loads(served):
    async with _http(served, key=None) as http:
        reply = await http.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
    assert reply.status_code == 401
    assert _entry(served, "llama").state == "unloaded"


async def test_each_model_answers_with_its_own_hf_greedy_tokens(served, expected):
    """The first request to an unloaded model waits for its load (seen as `loading`)."""
    seen: list[str] = []

    async def watch():
        while True:
            seen.append((await _statuses(served))["llama"]["value"])
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch())
    client = _client(served)
    try:
        assert await _complete(client, "llama") == expected["llama"]
    finally:
        watcher.cancel()
    assert "loading" in seen
    assert await _complete(client, "qwen") == expected["qwen"]
    assert expected["llama"] != expected["qwen"]  # two models, two answers
    statuses = await _statuses(served)
    assert statuses["llama"]["value"] == statuses["qwen"]["value"] == "loaded"
    await client.close()


async def test_a_broken_model_is_failed_with_its_error_while_the_others_serve(served, expected):
    client = _client(served)
    with pytest.raises(openai.APIStatusError) as failed:
        await _complete(client, "broken")
    assert failed.value.status_code == 503
    assert "model `broken` failed to load" in failed.value.message
    status = (await _statuses(served))["broken"]
    assert status["value"] == "failed" and status["failed"] is True and status["error"]
    assert await _complete(client, "llama") == expected["llama"]
    await client.close()


async def test_an_unknown_model_is_404_in_each_apis_shape(served):
    client = _client(served)
    with pytest.raises(openai.NotFoundError) as missing:
        await _complete(client, "no-such-model")
    assert missing.value.code == "model_not_found"
    await client.close()
    messages = {"model": "no-such-model", "max_tokens": 4, "messages": []}
    async with _http(served) as http:
        reply = await http.post("/v1/messages", json=messages)
    assert reply.status_code == 404 and reply.json()["type"] == "error"


async def test_keep_alive_zero_unloads_after_the_request_and_its_process_exits(served, expected):
    client = _client(served)
    assert await _complete(client, "qwen") == expected["qwen"]
    pid = _entry(served, "qwen").model.pid
    assert pid is not None and alive(pid)
    assert await _complete(client, "qwen", keep_alive=0) == expected["qwen"]
    await eventually_async(lambda: _entry(served, "qwen").state == "unloaded", "qwen unloaded")
    await eventually_async(lambda: not alive(pid), "the engine-core process gone")
    await client.close()


async def test_models_max_1_under_alternating_traffic_loses_no_request(served, expected):
    registry = served.registry
    registry.config = dataclasses.replace(registry.config, models_max=1)
    client = _client(served)
    try:
        names = ["llama", "qwen"] * 2
        texts = await asyncio.gather(*(_complete(client, n) for n in names))
        assert texts == [expected[n] for n in names]
        assert len(registry.loaded()) == 1
    finally:
        registry.config = dataclasses.replace(registry.config, models_max=2)
        await client.close()


async def test_the_memory_check_refuses_a_load_naming_both_figures(served):
    registry = served.registry
    async with _http(served) as http:
        for name in list(registry.entries):
            if name != "broken":
                await http.post("/models/unload", json={"model": name})
        assert registry.loaded() == []
        registry.config = dataclasses.replace(registry.config, models_memory="1KiB")
        try:
            reply = await http.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
        finally:
            registry.config = dataclasses.replace(registry.config, models_memory=None)
    assert reply.status_code == 503
    message = reply.json()["error"]["message"]
    assert "model `llama` needs" in message and "KV cache 0.01 GiB" in message
    assert "0.00 GiB is left of --models-memory" in message
    assert _entry(served, "llama").state == "unloaded"


async def test_load_and_unload_routes_and_per_model_metrics(served):
    async with _http(served) as http:
        loaded = await http.post("/models/load", json={"model": "llama"})
        assert loaded.status_code == 200 and loaded.json()["status"] == {"value": "loaded"}
        metrics = (await http.get("/metrics")).text
        assert 'pagestream:model_loaded{model_name="llama"} 1.0' in metrics
        assert 'pagestream:model_loaded{model_name="qwen"} 0.0' in metrics
        running = r'^pagestream:num_requests_running\{[^}]*model_name="llama"'
        assert re.search(running, metrics, re.MULTILINE)  # the model's own series, labelled
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/ready")).status_code == 200  # no pinned model waits
        unloaded = await http.post("/v1/models/unload", json={"model": "llama"})
        assert unloaded.status_code == 200 and unloaded.json()["status"] == {"value": "unloaded"}
        bad = await http.post("/models/load", json={"model": "nope"})
        assert bad.status_code == 404
