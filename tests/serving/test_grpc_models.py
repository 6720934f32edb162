"""The public gRPC API of a multi-model serve: each call's `model` picks one of a models
directory's two tiny random models (and a broken folder), through the real server and its
engine-core processes (one server for the module; loads cost seconds on two cores):
HF-equal greedy tokens per model, ListModels' states, NOT_FOUND / UNAVAILABLE /
RESOURCE_EXHAUSTED / INVALID_ARGUMENT, Abort and cancellation on a non-default model, and
a client that knows the API only through reflection."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import pytest_asyncio

from pagestream.cli import build_parser
from pagestream.models.models_serve import start_models_server
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from tests.helpers.eventually import eventually_async
from tests.helpers.grpc_calls import read_rest, reflected_method, request

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "grpc-models-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
TIMEOUT = 600.0  # a first load may compile the C++ kernels (minutes on 2 cores)
PROMPT = [5, 17, 42, 9, 33, 61, 7]
MAX_TOKENS = 6
FAMILIES = {"llama": "llama", "qwen": "qwen2"}  # served name -> tiny model family
BROKEN = "zz-broken"  # last by name: the default model is llama, the directory's first


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def served(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc-models")
    for name, family in FAMILIES.items():
        (root / name).symlink_to(model_dir(family))
    (root / BROKEN).mkdir()
    (root / BROKEN / "config.json").write_text("{not json")
    argv = ["serve", "--models-dir", str(root), "--port", "0", "--grpc-port", "0"]
    argv += ["--api-key", KEY, "--kv-cache-memory", "8MiB", "--swap-space", "0.01"]
    argv += ["--models-max", "2"]
    server = await start_models_server(build_parser().parse_args(argv))
    try:
        yield server
    finally:
        await asyncio.wait_for(server.stop(5.0), TIMEOUT)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stub(served):
    async with grpc.aio.insecure_channel(served.grpc_server.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def expected(model_dir, hf_greedy):
    """name -> HF float32 greedy new token ids of PROMPT."""
    return {n: hf_greedy(model_dir(f), PROMPT, MAX_TOKENS) for n, f in FAMILIES.items()}


def _greedy(model: str | None = None, **fields) -> pb.GenerateRequest:
    message = request(PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    if model is not None:
        message.model = model
    for name, value in fields.items():
        setattr(message, name, value)
    return message


async def _tokens(stub, message) -> list[int]:
    responses = [r async for r in stub.Generate(message, metadata=AUTH, timeout=TIMEOUT)]
    return [t for r in responses for t in r.token_ids]


async def _tokens_without_key(stub, message) -> list[int]:
    return [t async for r in stub.Generate(message, timeout=TIMEOUT) for t in r.token_ids]


async def _states(stub) -> dict[str, pb.ModelStatus]:
    listed = await stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=TIMEOUT)
    return {m.name: m for m in listed.models}


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value


def _entry(served, name):
    return served.registry.entries[name]


async def test_every_model_listed_unloaded_with_the_default_named(stub):
    listed = await stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=TIMEOUT)
    assert [m.name for m in listed.models] == ["llama", "qwen", BROKEN]
    assert listed.default_model == "llama"
    assert all(m.state == "unloaded" and m.max_model_len == 0 for m in listed.models)
    assert not any(m.pinned or m.error for m in listed.models)


async def test_without_the_key_nothing_loads(served, stub):
    refused = await _refused(_tokens_without_key(stub, _greedy("qwen")))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    listing = await _refused(stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT))
    assert listing.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _entry(served, "qwen").state == "unloaded"


async def test_each_model_generates_its_own_hf_greedy_tokens(served, stub, expected):
    """The default (no `model`) is llama; qwen loads on its first call."""
    assert expected["llama"] != expected["qwen"]  # two models, two answers
    assert await _tokens(stub, _greedy()) == expected["llama"]
    assert await _tokens(stub, _greedy("qwen")) == expected["qwen"]
    assert await _tokens(stub, _greedy("llama")) == expected["llama"]
    states = await _states(stub)
    assert states["llama"].state == states["qwen"].state == "loaded"
    assert states["qwen"].max_model_len > 0
    info = await stub.GetModelInfo(pb.GetModelInfoRequest(model="qwen"), metadata=AUTH)
    assert info.model == "qwen" and info.max_model_len == states["qwen"].max_model_len
    assert "Qwen2" in info.architecture
    tokens = pb.TokenizeRequest(text="hello", model="qwen")
    assert (await stub.Tokenize(tokens, metadata=AUTH)).count > 0
    assert _entry(served, "qwen").users == _entry(served, "llama").users == 0  # leases ended


async def test_an_unknown_model_is_not_found_naming_it(stub):
    refused = await _refused(_tokens(stub, _greedy("no-such-model")))
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in refused.details()
    info = await _refused(stub.GetModelInfo(pb.GetModelInfoRequest(model="nope"), metadata=AUTH))
    assert info.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.details()


async def test_a_broken_model_is_unavailable_with_its_error(stub, expected):
    refused = await _refused(_tokens(stub, _greedy(BROKEN)))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert f"model `{BROKEN}` failed to load" in refused.details()
    broken = (await _states(stub))[BROKEN]
    assert broken.state == "failed" and broken.error
    assert await _tokens(stub, _greedy("qwen")) == expected["qwen"]  # the others serve


async def test_a_bad_keep_alive_is_invalid_argument_before_any_load(served, stub):
    await served.registry.unload("qwen")
    refused = await _refused(_tokens(stub, _greedy("qwen", keep_alive="5 parsecs")))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "keep_alive" in refused.details()
    assert _entry(served, "qwen").state == "unloaded"


async def test_keep_alive_zero_unloads_the_model_after_the_call(served, stub, expected):
    assert await _tokens(stub, _greedy("qwen", keep_alive="0")) == expected["qwen"]
    await eventually_async(lambda: _entry(served, "qwen").state == "unloaded", "qwen unloaded")


async def test_abort_ends_a_live_stream_on_the_non_default_model(served, stub):
    message = request(PROMPT, max_tokens=100_000, ignore_eos=True)
    message.model, message.request_id = "qwen", "to-abort"
    call = stub.Generate(message, metadata=AUTH, timeout=TIMEOUT)
    responses = [await call.read()]
    assert _entry(served, "qwen").users == 1  # the stream holds its model
    aborted = await stub.Abort(pb.AbortRequest(request_id="to-abort"), metadata=AUTH)
    assert aborted.found
    responses += await read_rest(call)
    assert responses[-1].finish_reason == "abort" and responses[-1].HasField("usage")
    missing = await stub.Abort(pb.AbortRequest(request_id="to-abort"), metadata=AUTH)
    assert not missing.found
    await eventually_async(lambda: _entry(served, "qwen").users == 0, "qwen's lease released")


async def test_a_cancelled_stream_aborts_its_request_and_releases_its_model(served, stub):
    message = request(PROMPT, max_tokens=100_000, ignore_eos=True)
    message.model = "qwen"
    call = stub.Generate(message, metadata=AUTH, timeout=TIMEOUT)
    await call.read()
    call.cancel()
    await eventually_async(lambda: _entry(served, "qwen").users == 0, "qwen's lease released")
    engine = _entry(served, "qwen").model.engine
    await eventually_async(lambda: engine.frontend.num_live_requests() == 0, "request aborted")


async def test_the_memory_check_is_resource_exhausted_naming_both_figures(served, stub):
    registry = served.registry
    for name in ("llama", "qwen"):
        await registry.unload(name)
    registry.config = dataclasses.replace(registry.config, models_memory="1KiB")
    try:
        refused = await _refused(_tokens(stub, _greedy("llama")))
    finally:
        registry.config = dataclasses.replace(registry.config, models_memory=None)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "model `llama` needs" in refused.details()
    assert "0.00 GiB is left of --models-memory" in refused.details()
    assert _entry(served, "llama").state == "unloaded"


async def test_a_reflection_only_client_lists_and_picks_a_model(served, expected):
    target = served.grpc_server.address
    list_request, list_response = await asyncio.to_thread(reflected_method, target, "ListModels")
    generate_request, generate_response = await asyncio.to_thread(
        reflected_method, target, "Generate"
    )
    assert generate_request is not pb.GenerateRequest  # built from the server's descriptors
    message = generate_request(model="qwen", keep_alive="1m")
    message.token_ids.token_ids.extend(PROMPT)
    message.sampling_params.max_tokens = MAX_TOKENS
    message.sampling_params.temperature = 0.0
    async with grpc.aio.insecure_channel(target) as channel:
        generate = channel.unary_stream(
            "/pagestream.v1.Generation/Generate",
            request_serializer=generate_request.SerializeToString,
            response_deserializer=generate_response.FromString,
        )
        responses = [r async for r in generate(message, metadata=AUTH, timeout=TIMEOUT)]
        list_models = channel.unary_unary(
            "/pagestream.v1.Generation/ListModels",
            request_serializer=list_request.SerializeToString,
            response_deserializer=list_response.FromString,
        )
        listed = await list_models(list_request(), metadata=AUTH, timeout=TIMEOUT)
    assert [t for r in responses for t in r.token_ids] == expected["qwen"]
    states = {m.name: m.state for m in listed.models}
    assert states["qwen"] == "loaded" and listed.default_model == "llama"
