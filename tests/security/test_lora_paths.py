"""Hostile LoRA loads against a real HTTP server over the tiny llama, started as
`serve --enable-lora --lora-modules first=OUTSIDE --enable-lora-runtime-updates
--lora-root ROOT --max-runtime-loras 2` would start it.

Probing the file system through /v1/load_lora_adapter learns nothing: a missing path, a
path outside the root (directly, by `..` or through a symlink in the root, of the folder
or of one adapter file), a file, a folder that is no adapter and a malformed adapter all
get the same answer, fast, and nothing is loaded. The operator's adapters can be neither
replaced nor unloaded by a client; /v1/models shows no path; an adapter is read and
hashed off the event loop (/health answers while a load is held in its thread); clients'
adapters are counted; the adapter files' sizes are bounded by what their header and the
base model allow. A good adapter under the root still loads and serves.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import threading
import time

import pytest
import pytest_asyncio

from pagestream import SamplingParams
from pagestream.cli import build_parser
from pagestream.engine_args import EngineArgs
from pagestream.roles import load_lora_modules
from services.common.convert.lora import lora_card_to_pb, lora_to_pb
from services.common.flags import from_flags
from services.common.lora_adapter import MAX_CONFIG_BYTES, LoRAAdapterError, inspect_adapter
from services.common.lora_config import LoRAConfig, LoRATargets
from services.common.lora_request import LoRARequest
from services.frontend import lora_registry
from services.frontend.lora_options import LoRAServerOptions
from services.frontend.openai import build_app
from services.frontend.openai.serving_lora import REFUSED_PATH
from tests.helpers.lora_adapters import save_adapter
from tests.helpers.openai_server import MODEL, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [5, 17, 33, 99, 250, 12, 8, 41]
GREEDY = {"temperature": 0, "max_tokens": 6}
OPERATOR = "first"  # --lora-modules first=PATH, a path outside the root
ANSWER_S = 5.0  # every refusal, and /health during a load, answers within this


@pytest.fixture(scope="module")
def places(model_dir, tmp_path_factory):
    """The root and the files around it: good (an adapter in the root), outside (an
    adapter beside the root), and the hostile entries in the root."""
    base = model_dir("llama")
    top = tmp_path_factory.mktemp("lora_paths")
    root, outside = top / "root", top / "outside"
    root.mkdir()
    save_adapter(base, root / "good", r=8, seed=3)
    save_adapter(base, outside, r=8, seed=4)
    (root / "not_an_adapter").mkdir()
    (root / "plain_file").write_text("hello")
    os.symlink(outside, root / "link_out")  # a folder link pointing out of the root
    half = shutil.copytree(root / "good", root / "weights_link_out")
    (half / "adapter_model.safetensors").unlink()
    os.symlink(outside / "adapter_model.safetensors", half / "adapter_model.safetensors")
    os.symlink(root / "good", root / "link_in")  # a link that stays inside is fine
    grown = shutil.copytree(root / "good", root / "trailing_bytes")
    with (grown / "adapter_model.safetensors").open("ab") as f:
        f.write(b"\0" * 4096)
    return {"base": base, "top": top, "root": root, "outside": outside}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(places):
    argv = [
        *("serve", str(places["base"]), "--enable-lora", "--max-loras", "2"),
        *("--lora-modules", f"{OPERATOR}={places['outside']}"),
        *("--enable-lora-runtime-updates", "--lora-root", str(places["root"])),
        *("--max-runtime-loras", "2"),
    ]
    ns = build_parser().parse_args(argv)
    args = from_flags(EngineArgs, ns)
    lora = {name: getattr(args, name) for name in ("enable_lora", "max_loras", "max_lora_rank")}
    app_options = {"lora": from_flags(LoRAServerOptions, ns)}
    async with running_server(places["base"], app_options=app_options, **lora) as s:
        load_lora_modules(s.engine.frontend, ns)
        yield s


async def _post(server, route: str, body: dict):
    async with server.raw() as client:
        return await client.post(f"/v1/{route}", json=body)


async def _load(server, name: str, path, **extra):
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return await _post(server, "load_lora_adapter", body)


async def _unload(server, name: str):
    return await _post(server, "unload_lora_adapter", {"lora_name": name})


async def _text(server, model: str) -> str:
    response = await server.async_client().completions.create(model=model, prompt=PROMPT, **GREEDY)
    return response.choices[0].text


def _served(server) -> set[str]:
    return set(server.engine.frontend.input_processor.loras.adapters)


# ---- probing the file system -------------------------------------------------------------
def _probes(places) -> dict[str, str]:
    root, outside, top = places["root"], places["outside"], places["top"]
    return {
        "missing in the root": str(root / "nowhere"),
        "missing outside": "/nonexistent/adapter",
        "an adapter outside": str(outside),
        "outside by ..": str(root / ".." / "outside"),
        "outside, relative": "../outside",
        "a system folder": "/etc",
        "a system file": "/etc/passwd",
        "the parent": str(top),
        "a folder that is no adapter": str(root / "not_an_adapter"),
        "a file in the root": str(root / "plain_file"),
        "a folder link out": str(root / "link_out"),
        "a weights link out": str(root / "weights_link_out"),
        "trailing bytes": str(root / "trailing_bytes"),
        "a null byte": str(root / "good") + "\0x",
        "a long path": "/" + "a" * 5000,
        "empty": "",
    }


async def test_every_refused_path_gets_the_same_answer_fast(server, places):
    before = _served(server)
    answers = {}
    for what, path in _probes(places).items():
        started = time.monotonic()
        response = await _load(server, "probe", path)
        assert time.monotonic() - started < ANSWER_S, what
        assert response.status_code == 400, what
        answers[what] = response.json()
    first = next(iter(answers.values()))
    assert first["error"]["message"] == REFUSED_PATH and first["error"]["param"] == "lora_path"
    for what, answer in answers.items():
        assert answer == first, what
    assert _served(server) == before
    assert str(places["top"]) not in json.dumps(answers)


async def test_the_log_keeps_the_reason(server, places, caplog):
    with caplog.at_level("WARNING", logger="services.frontend.openai.serving_lora"):
        await _load(server, "probe", places["root"] / "link_out")
        await _load(server, "probe", places["root"] / "trailing_bytes")
    assert f"outside --lora-root {places['root']}" in caplog.text
    assert "bytes of data; its tensors take" in caplog.text


# ---- the operator's adapters -------------------------------------------------------------
async def test_operator_adapters_can_be_neither_replaced_nor_unloaded(server, places):
    served = await _text(server, OPERATOR)
    good = places["root"] / "good"
    for inplace in (True, False):
        response = await _load(server, OPERATOR, good, load_inplace=inplace)
        assert response.status_code == 400
        error = response.json()["error"]
        assert f"'{OPERATOR}'" in error["message"] and "--lora-modules" in error["message"]
        assert error["param"] == "lora_name"
    response = await _unload(server, OPERATOR)
    assert response.status_code == 400
    assert "cannot unload" in response.json()["error"]["message"]
    assert OPERATOR in _served(server) and await _text(server, OPERATOR) == served


# ---- what clients see --------------------------------------------------------------------
async def test_models_show_no_path(server, places):
    assert (await _load(server, "shown", places["root"] / "good")).status_code == 200
    try:
        async with server.raw() as client:
            listing = await client.get("/v1/models")
            one = await client.get(f"/v1/models/{OPERATOR}")
        ids = {card["id"] for card in listing.json()["data"]}
        assert {MODEL, OPERATOR, "shown"} <= ids
        for text in (listing.text, one.text):
            assert str(places["top"]) not in text
        assert one.json()["root"] is None and one.json()["parent"] == MODEL
    finally:
        assert (await _unload(server, "shown")).status_code == 200


def test_the_grpc_card_has_no_path(places):
    lora = LoRARequest("a", 7, str(places["outside"]), "base", digest="0123456789abcdef")
    card = lora_card_to_pb(lora)
    assert (card.name, card.id, card.digest, card.base_model_name) == ("a", 7, lora.digest, "base")
    assert "path" not in card.DESCRIPTOR.fields_by_name  # the public card has no path field
    assert lora_to_pb(lora).path == str(places["outside"])


# ---- loads that work ---------------------------------------------------------------------
async def test_a_good_adapter_under_the_root_loads_and_serves(server, places):
    base = await _text(server, MODEL)
    for name, path in (("abs", places["root"] / "good"), ("rel", "link_in")):
        response = await _load(server, name, path)
        assert response.status_code == 200, response.text
    try:
        served = server.engine.frontend.input_processor.loras
        assert served.get("abs").lora_path == served.get("rel").lora_path
        assert served.get("abs").lora_path == os.path.realpath(places["root"] / "good")
        lora = served.get("abs")
        params = SamplingParams(**GREEDY)
        prompt = {"prompt_token_ids": PROMPT}
        final = [o async for o in server.engine.generate(prompt, params, lora_request=lora)][-1]
        text = await _text(server, "abs")
        assert text == final.outputs[0].text != base
        assert await _text(server, "rel") == text
    finally:
        for name in ("abs", "rel"):
            assert (await _unload(server, name)).status_code == 200


async def test_clients_adapters_are_counted(server, places):
    good = places["root"] / "good"
    for name in ("one", "two"):
        assert (await _load(server, name, good)).status_code == 200
    try:
        response = await _load(server, "three", good)
        assert response.status_code == 400
        assert "--max-runtime-loras" in response.json()["error"]["message"]
        replaced = await _load(server, "two", good, load_inplace=True)
        assert replaced.status_code == 200  # replacing one adds none
    finally:
        for name in ("one", "two"):
            assert (await _unload(server, name)).status_code == 200
    assert "three" not in _served(server)


async def test_a_long_name_is_refused_naming_the_field(server, places):
    response = await _load(server, "n" * 10_000, places["root"] / "good")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "lora_name" and "1 to 256 characters" in error["message"]
    assert len(error["message"]) < 1000


async def test_the_adapter_is_read_off_the_event_loop(server, places, monkeypatch):
    """A load held inside its check leaves the server answering /health."""
    entered, release = threading.Event(), threading.Event()
    inspect = lora_registry.inspect_adapter

    def held(*args):
        entered.set()
        release.wait(30)
        return inspect(*args)

    monkeypatch.setattr(lora_registry, "inspect_adapter", held)
    load = asyncio.create_task(_load(server, "held", places["root"] / "good"))
    try:
        assert await asyncio.to_thread(entered.wait, ANSWER_S)
        async with server.raw(api_key=None) as client:
            health = await asyncio.wait_for(client.get("/health"), ANSWER_S)
        assert health.status_code == 200 and not load.done()
    finally:
        release.set()
    assert (await load).status_code == 200
    assert (await _unload(server, "held")).status_code == 200


# ---- the options -------------------------------------------------------------------------
def test_runtime_updates_need_a_root(tmp_path):
    with pytest.raises(ValueError, match=r"--enable-lora-runtime-updates needs --lora-root"):
        LoRAServerOptions(enable_lora_runtime_updates=True)
    with pytest.raises(ValueError, match=r"--max-runtime-loras must be >= 1, got 0"):
        LoRAServerOptions(max_runtime_loras=0)
    argv = ["serve", "m", "--enable-lora-runtime-updates"]
    with pytest.raises(ValueError, match=r"--lora-root"):
        from_flags(LoRAServerOptions, build_parser().parse_args(argv))


async def test_a_root_that_is_no_folder_stops_the_start(server, tmp_path):
    options = LoRAServerOptions(lora_root=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"--lora-root '.*missing': not a directory"):
        build_app(server.engine.frontend, [MODEL], lora=options)


# ---- hostile adapter files (inspect_adapter) ---------------------------------------------
CONFIG = LoRAConfig(max_lora_rank=16)


def _targets(base) -> LoRATargets:
    from transformers import AutoConfig

    from services.worker.lora.lora_layout import model_modules

    text = AutoConfig.from_pretrained(base)
    return LoRATargets(model_modules(text), int(text.num_hidden_layers))


def _with_header(folder, edit) -> None:
    """Rewrite the weights file with `edit(header)` applied and the same data."""
    file = folder / "adapter_model.safetensors"
    raw = file.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def _first_tensor(header) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("trailing", r"holds \d+ bytes of data; its tensors take \d+"),
        ("dtype", r"has dtype 'I64'; LoRA weights must be one of F16, BF16, F32, F64"),
        ("offsets", r"data_offsets \[0, 1\]; its \d+ bytes must start at"),
        ("offset_type", r"data_offsets \['0', 4\], not \[begin, end\]"),
        ("huge_header", r"not a safetensors file \(a header of 9223372036854775807 bytes"),
        ("header_list", r"not a safetensors file \(the header is not a JSON object\)"),
        ("big_config", rf"adapter_config\.json: not readable JSON \(over {MAX_CONFIG_BYTES} bytes"),
    ],
)
def test_hostile_adapter_files_are_refused_naming_the_problem(places, tmp_path, damage, match):
    folder = shutil.copytree(places["root"] / "good", tmp_path / "adapter")
    weights = folder / "adapter_model.safetensors"
    if damage == "trailing":
        with weights.open("ab") as f:
            f.write(b"\0")
    elif damage == "dtype":
        _with_header(folder, lambda h: _first_tensor(h).update(dtype="I64"))
    elif damage == "offsets":
        _with_header(folder, lambda h: _first_tensor(h).update(data_offsets=[0, 1]))
    elif damage == "offset_type":
        _with_header(folder, lambda h: _first_tensor(h).update(data_offsets=["0", 4]))
    elif damage == "huge_header":
        weights.write_bytes(struct.pack("<Q", (1 << 63) - 1) + b"{}")
    elif damage == "header_list":
        weights.write_bytes(struct.pack("<Q", 2) + b"[]")
    else:
        config = json.loads((folder / "adapter_config.json").read_text())
        config["padding"] = " " * MAX_CONFIG_BYTES
        (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAAdapterError, match=match):
        inspect_adapter(str(folder), CONFIG, _targets(places["base"]))
