"""LoRA adapters through the public APIs of a real server over the tiny llama: started as
`serve --enable-lora --max-loras 2 --lora-modules first=PATH --enable-lora-runtime-updates
--lora-root ROOT` would start it, and used with the official `openai` client and gRPC.

An adapter named as the model gives PEFT's greedy output for that adapter (and not the
base model's); /v1/models lists it under the base, without its path; adapters load and
unload at run time from under the root (an unloaded one is an unknown model, a reload
under the same name serves the new weights, a bad one is refused with the one refusal
text, its reason in the server log, and changes nothing); with runtime updates off the
routes answer 404; chat streams end with a final chunk; several adapters
and the base run in one batch; gRPC Generate takes lora_name and GetModelInfo lists the
adapters; /metrics shows pagestream:lora_requests_info."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil

import grpc
import openai
import pytest
import pytest_asyncio

from pagestream import SamplingParams
from pagestream.cli import build_parser
from pagestream.engine_args import EngineArgs
from pagestream.roles import load_lora_modules
from services.common.flags import from_flags
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.frontend.frontend_server import serve_frontend
from services.frontend.lora_options import LoRAServerOptions
from services.frontend.openai import build_app, serve_http
from services.frontend.openai.serving_lora import REFUSED_PATH
from services.frontend.tokenizer import apply_chat_template
from tests.helpers.eventually import eventually_async
from tests.helpers.grpc_calls import collect, per_index, request
from tests.helpers.lora_adapters import TARGETS, peft_greedy, peft_logprobs, save_adapter
from tests.helpers.openai_server import API_KEY, MODEL, TIMEOUT, httpx, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]
MAX_TOKENS = 6
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}
CHAT = [{"role": "user", "content": "Paged attention stores keys"}]
FIRST = "first"  # served from the start (--lora-modules name=path)
NAMED, PARENT = "named", "tiny-llama-base"  # and in the JSON form, with a base_model_name


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    """--lora-root: every adapter folder of this module is in it."""
    return tmp_path_factory.mktemp("lora_root")


@pytest.fixture(scope="module")
def adapters(model_dir, lora_root):
    """Adapter folders of the tiny llama: first (rank 8), second (rsLoRA, rank 4, every
    target) and third (rank 8, other weights); too_big has rank 32 (max_lora_rank is 16),
    head targets the LM head."""
    base = model_dir("llama")

    def make(name, **kwargs):
        return save_adapter(base, lora_root / name, **kwargs)

    return {
        "first": make("first", r=8, lora_alpha=16, seed=0),
        "second": make(
            "second",
            r=4,
            lora_alpha=8,
            use_rslora=True,
            seed=1,
            target_modules=(*TARGETS, "k_proj", "gate_proj"),
        ),
        "third": make("third", r=8, lora_alpha=8, seed=2),
        "too_big": make("too_big", r=32, lora_alpha=32, target_modules=("q_proj",)),
        "head": make("head", target_modules=("q_proj", "lm_head")),
    }


class Reference:
    """PEFT over the tiny llama: `reference(adapter)` its greedy ids for PROMPT (None:
    the base), `logprobs(adapter, ids)` its logprob of each of ids after PROMPT."""

    def __init__(self, base) -> None:
        self.base = base

    def __call__(self, adapter) -> list[int]:
        return peft_greedy(self.base, adapter, PROMPT, MAX_TOKENS)

    def logprobs(self, adapter, ids: list[int]) -> list[float]:
        rows = peft_logprobs(self.base, adapter, PROMPT + ids)
        return [rows[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(ids)]


@pytest.fixture(scope="module")
def reference(model_dir):
    return Reference(model_dir("llama"))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(server_model, adapters, lora_root):
    argv = [
        "serve",
        str(server_model),
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"{FIRST}={adapters['first']}",
        json.dumps({"name": NAMED, "path": str(adapters["third"]), "base_model_name": PARENT}),
        "--enable-lora-runtime-updates",
        "--lora-root",
        str(lora_root),
    ]
    ns = build_parser().parse_args(argv)
    args = from_flags(EngineArgs, ns)
    lora = {name: getattr(args, name) for name in ("enable_lora", "max_loras", "max_lora_rank")}
    app_options = {"lora": from_flags(LoRAServerOptions, ns)}
    async with running_server(server_model, app_options=app_options, **lora) as s:
        load_lora_modules(s.engine.frontend, ns)  # as `serve` does before it answers
        yield s


async def _post(server, route: str, body: dict):
    async with server.raw() as client:
        return await client.post(f"/v1/{route}", json=body)


async def _load(server, name: str, path, **extra):
    return await _post(
        server, "load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra}
    )


async def _unload(server, name: str):
    return await _post(server, "unload_lora_adapter", {"lora_name": name})


async def _complete(server, model: str, prompt=PROMPT, **kwargs):
    response = await server.async_client().completions.create(
        model=model, prompt=prompt, **{**GREEDY, **kwargs}
    )
    return response.choices[0]


async def _engine_output(server, lora_name: str | None):
    """The in-process engine's greedy output for PROMPT under the adapter served as
    lora_name (None: the base)."""
    lora = server.engine.frontend.input_processor.loras.get(lora_name) if lora_name else None
    assert lora_name is None or lora is not None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    final = None
    prompt = {"prompt_token_ids": PROMPT}
    async for output in server.engine.generate(prompt, params, lora_request=lora):
        final = output
    return final.outputs[0]


async def _assert_peft_output(server, reference, choice, lora_name, adapter) -> None:
    """The choice (logprobs=1) is PEFT's greedy output for `adapter`: the engine's ids
    under the adapter served as lora_name are PEFT's, the choice's text is the engine's,
    and each of its tokens' logprobs is PEFT's."""
    expected = reference(adapter)
    engine = await _engine_output(server, lora_name)
    assert engine.token_ids == expected
    assert choice.text == engine.text
    want = reference.logprobs(adapter, expected)
    assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-3)


# ---- served from the start -----------------------------------------------------------------
async def test_models_list_the_adapter_under_the_base(server):
    models = await server.async_client().models.list()
    cards = {m.id: m for m in models.data}
    assert models.data[0].id == MODEL and FIRST in cards
    assert cards[FIRST].parent == MODEL and cards[FIRST].root is None
    assert getattr(cards[MODEL], "parent", None) is None
    card = await server.async_client().models.retrieve(FIRST)
    assert (card.id, card.parent) == (FIRST, MODEL)
    assert card.max_model_len == cards[MODEL].max_model_len
    assert cards[NAMED].parent == PARENT and cards[NAMED].root is None


async def test_an_adapter_gives_peft_s_greedy_output(server, adapters, reference):
    expected = reference(adapters["first"])
    base = reference(None)
    assert expected != base  # the adapter changes what the model says
    choice = await _complete(server, FIRST, logprobs=1)
    await _assert_peft_output(server, reference, choice, FIRST, adapters["first"])
    plain = await _complete(server, MODEL, logprobs=1)
    await _assert_peft_output(server, reference, plain, None, None)
    assert plain.text != choice.text


async def test_chat_with_an_adapter_streams_to_a_final_chunk(server):
    client = server.async_client()
    whole = await client.chat.completions.create(model=FIRST, messages=CHAT, **GREEDY)
    base = await client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert whole.model == FIRST and whole.choices[0].message.content
    lora = server.engine.frontend.input_processor.loras.get(FIRST)
    chat_text = apply_chat_template(server.engine.tokenizer, CHAT)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = server.engine.generate(chat_text, params, add_special_tokens=False, lora_request=lora)
    final = [output async for output in outputs][-1]
    assert whole.choices[0].message.content == final.outputs[0].text
    assert whole.choices[0].message.content != base.choices[0].message.content
    stream = await client.chat.completions.create(
        model=FIRST,
        messages=CHAT,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = [chunk async for chunk in stream]
    assert {c.model for c in chunks} == {FIRST}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == whole.choices[0].message.content
    assert finishes[-1] == whole.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert not chunks[-1].choices  # the final chunk: the usage
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


async def test_responses_with_an_adapter_equal_its_chat(server):
    client = server.async_client()
    chat = await client.chat.completions.create(model=FIRST, messages=CHAT, **GREEDY)
    base = await client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    kwargs = {"input": CHAT, "temperature": 0, "max_output_tokens": MAX_TOKENS}
    response = await client.responses.create(model=FIRST, **kwargs)
    assert response.model == FIRST
    assert response.output_text == chat.choices[0].message.content
    assert response.output_text != base.choices[0].message.content
    plain = await client.responses.create(model=MODEL, **kwargs)
    assert plain.output_text == base.choices[0].message.content


async def test_seeded_n2_with_an_adapter_equals_the_engine(server):
    sampling = {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": MAX_TOKENS}
    response = await server.async_client().completions.create(
        model=FIRST, prompt=PROMPT, extra_body={"ignore_eos": True}, **sampling
    )
    lora = server.engine.frontend.input_processor.loras.get(FIRST)
    params = SamplingParams(ignore_eos=True, **sampling)
    outputs = server.engine.generate({"prompt_token_ids": PROMPT}, params, lora_request=lora)
    final = [output async for output in outputs][-1]
    assert [c.text for c in response.choices] == [o.text for o in final.outputs]
    base = server.engine.generate({"prompt_token_ids": PROMPT}, params)
    base_final = [output async for output in base][-1]
    assert [o.token_ids for o in base_final.outputs] != [o.token_ids for o in final.outputs]


async def test_an_unknown_model_is_404_model_not_found(server):
    with pytest.raises(openai.NotFoundError) as err:
        await _complete(server, "nope")
    assert err.value.status_code == 404 and err.value.code == "model_not_found"
    assert "nope" in err.value.message


# ---- loading and unloading at run time ---------------------------------------------------
async def test_load_use_unload_and_reload_with_other_weights(
    server, adapters, reference, lora_root
):
    folder = shutil.copytree(adapters["second"], lora_root / "runtime")
    response = await _load(server, "runtime", folder)
    assert response.status_code == 200 and "runtime" in response.text
    models = await server.async_client().models.list()
    assert {m.id: m.parent for m in models.data}["runtime"] == MODEL
    choice = await _complete(server, "runtime", logprobs=1)
    await _assert_peft_output(server, reference, choice, "runtime", adapters["second"])
    assert reference(adapters["second"]) != reference(adapters["first"])

    response = await _unload(server, "runtime")
    assert response.status_code == 200 and "runtime" in response.text
    with pytest.raises(openai.NotFoundError) as err:
        await _complete(server, "runtime")
    assert err.value.code == "model_not_found"
    models = await server.async_client().models.list()
    assert "runtime" not in {m.id for m in models.data}

    # other weights in the same folder, under the same name: the new weights answer (the
    # old ones' prefix-cache blocks and loaded copies are never used for them)
    shutil.rmtree(folder)
    shutil.copytree(adapters["third"], folder)
    assert (await _load(server, "runtime", folder)).status_code == 200
    try:
        choice = await _complete(server, "runtime", logprobs=1)
        assert reference(adapters["third"]) != reference(adapters["second"])
        await _assert_peft_output(server, reference, choice, "runtime", adapters["third"])
    finally:
        assert (await _unload(server, "runtime")).status_code == 200


async def test_load_inplace_replaces_an_adapter(server, adapters, reference):
    assert (await _load(server, "inplace", adapters["second"])).status_code == 200
    try:
        again = await _load(server, "inplace", adapters["third"])
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        replaced = await _load(server, "inplace", adapters["third"], load_inplace=True)
        assert replaced.status_code == 200
        choice = await _complete(server, "inplace", logprobs=1)
        await _assert_peft_output(server, reference, choice, "inplace", adapters["third"])
        # a bad replacement leaves the adapter it would have replaced
        bad = await _load(server, "inplace", adapters["too_big"], load_inplace=True)
        assert bad.status_code == 400
        assert (await _complete(server, "inplace")).text == choice.text
    finally:
        assert (await _unload(server, "inplace")).status_code == 200


@pytest.mark.parametrize(
    ("path_key", "match"),
    [
        ("missing", "which is not a directory"),
        ("too_big", "rank 32 is over max_lora_rank (16)"),
        ("head", "the LM head"),
        ("no_config", "adapter_config.json is missing"),
    ],
)
async def test_a_bad_load_is_400_and_the_log_names_the_problem(
    server, adapters, lora_root, caplog, path_key, match
):
    (lora_root / "empty").mkdir(exist_ok=True)
    paths = {**adapters, "missing": lora_root / "nowhere", "no_config": lora_root / "empty"}
    with caplog.at_level(logging.WARNING, logger="services.frontend.openai.serving_lora"):
        response = await _load(server, "bad", paths[path_key])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == REFUSED_PATH and error["param"] == "lora_path"
    assert match in caplog.text and "'bad'" in caplog.text
    models = await server.async_client().models.list()
    assert "bad" not in {m.id for m in models.data}
    with pytest.raises(openai.NotFoundError):
        await _complete(server, "bad")
    assert (await _complete(server, FIRST)).text  # the server keeps serving


async def test_names_that_cannot_be_loaded_or_unloaded(server, adapters):
    taken = await _load(server, MODEL, adapters["second"])
    assert taken.status_code == 400 and "cannot name an adapter" in taken.json()["error"]["message"]
    response = await _unload(server, "never-loaded")
    assert response.status_code == 404
    assert "no LoRA adapter named 'never-loaded' is loaded" in response.json()["error"]["message"]


async def test_with_runtime_updates_off_the_routes_are_404(server, adapters):
    app = build_app(server.engine.frontend, [MODEL], api_key=API_KEY)  # the flag's default
    http = await serve_http(app, "127.0.0.1", 0)
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=http.url, headers=headers, timeout=TIMEOUT) as c:
            body = {"lora_name": "off", "lora_path": str(adapters["second"])}
            load = await c.post("/v1/load_lora_adapter", json=body)
            unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": FIRST})
            models = (await c.get("/v1/models")).json()
        for response in (load, unload):
            assert response.status_code == 404
            assert "--enable-lora-runtime-updates" in response.json()["error"]["message"]
        assert FIRST in {m["id"] for m in models["data"]}  # nothing changed
        assert server.engine.frontend.input_processor.loras.get("off") is None
    finally:
        await http.stop()


# ---- several adapters at once ----------------------------------------------------------------
async def test_three_adapters_and_the_base_in_flight_through_two_slots(server, adapters, reference):
    names = {"second": "batch-second", "third": "batch-third"}
    for key, name in names.items():
        assert (await _load(server, name, adapters[key])).status_code == 200
    try:
        models = [FIRST, *names.values(), MODEL] * 2
        keys = ["first", "second", "third", None] * 2
        # four adapters' worth of requests at once (one waits for a slot), in one batch
        outputs = await asyncio.gather(
            *(_engine_output(server, None if m == MODEL else m) for m in models)
        )
        for model, key, output in zip(models, keys, outputs, strict=True):
            assert output.token_ids == reference(adapters[key] if key else None), model
        choices = await asyncio.gather(*(_complete(server, m) for m in models))
        for model, output, choice in zip(models, outputs, choices, strict=True):
            assert choice.text == output.text, model
    finally:
        for name in names.values():
            assert (await _unload(server, name)).status_code == 200
    stats = server.engine.engine.scheduler.get_stats()
    assert stats.max_lora == 2


# ---- gRPC ------------------------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(server):
    handle = await serve_frontend(server.engine.frontend, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        yield generation_pb2_grpc.GenerationStub(channel)
    await handle.stop(grace=None)


async def test_grpc_generate_with_lora_name(stub, adapters, reference):
    message = request(PROMPT, **GREEDY)
    message.lora_name = FIRST
    got = per_index(await collect(stub, message))
    assert got[0]["token_ids"] == reference(adapters["first"])
    base = per_index(await collect(stub, request(PROMPT, **GREEDY)))
    assert base[0]["token_ids"] == reference(None)


async def test_grpc_unknown_lora_name_is_invalid_argument(stub):
    message = request(PROMPT, **GREEDY)
    message.lora_name = "nope"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub, message)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_name 'nope'" in err.value.details()
    assert f"served: {FIRST}, {NAMED}" in err.value.details()


async def test_grpc_model_info_lists_the_adapters(stub):
    info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    listed = {a.name: a for a in info.lora_adapters}
    assert set(listed) == {FIRST, NAMED}
    assert listed[NAMED].base_model_name == PARENT and not listed[FIRST].base_model_name
    assert listed[FIRST].id >= 1
    assert len(listed[FIRST].digest) == 16
    assert "path" not in listed[FIRST].DESCRIPTOR.fields_by_name  # no paths to clients
    config = info.capabilities.lora
    assert (config.max_loras, config.max_lora_rank, config.num_layers) == (2, 16, 2)
    assert (config.modules["q_proj"].in_features, config.modules["q_proj"].out_features) == (
        64,
        64,
    )


# ---- /metrics --------------------------------------------------------------------------------
def _lora_info(samples: dict[str, float]) -> list[str]:
    return [k for k in samples if k.startswith("pagestream:lora_requests_info{")]


async def test_metrics_show_the_adapters_of_running_requests(server):
    stream = await server.async_client().completions.create(
        model=FIRST,
        prompt=PROMPT,
        max_tokens=240,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async with stream:
        await stream.__anext__()  # it runs

        async def running() -> list[str]:
            keys = _lora_info(await server.metrics())
            return [k for k in keys if f'running_lora_adapters="{FIRST}"' in k]

        (key,) = await eventually_async(running, "first among the running adapters")
        assert 'max_lora="2"' in key and 'engine="0"' in key
    samples = await server.wait_until_idle()
    (idle,) = _lora_info(samples)
    assert 'running_lora_adapters=""' in idle and 'waiting_lora_adapters=""' in idle
    assert samples[idle] > 0  # the time of the stats


async def test_an_adapter_whose_folder_is_gone_fails_only_its_requests(server, adapters, lora_root):
    folder = shutil.copytree(adapters["second"], lora_root / "gone")
    assert (await _load(server, "gone", folder)).status_code == 200
    shutil.rmtree(folder)
    with pytest.raises(openai.APIError, match=r"adapter_config\.json|does not exist"):
        await _complete(server, "gone")
    assert (await _complete(server, FIRST)).text  # the engine serves on
    assert (await _unload(server, "gone")).status_code == 200
