"""The Generation API's `model` on a one-model server (OneFrontend): its served name or
unset serve it, any other name is NOT_FOUND (as the OpenAI routes check it), a LoRA
adapter's name points at lora_name, keep_alive is ignored; ListModels lists the one model."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from services.common.engine_errors import EngineUnavailableError
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.frontend.frontend_source import OneFrontend
from services.frontend.openai.exceptions import ModelNotFoundError
from tests.helpers.grpc_calls import PROMPT_IDS, TIMEOUT, collect, request


def _greedy(**fields) -> pb.GenerateRequest:
    message = request(PROMPT_IDS, temperature=0, max_tokens=5, ignore_eos=True)
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def _tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def test_the_served_name_or_none_is_served_and_another_is_not_found(engine, stub):
    name = engine.frontend.info.model
    plain = _tokens(await collect(stub, _greedy()))
    named = _tokens(await collect(stub, _greedy(model=name, keep_alive="5m")))
    assert named == plain and len(plain) == 5
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await collect(stub, _greedy(model="other-model"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "other-model" in missing.value.details()
    info = pb.GetModelInfoRequest(model="other-model")
    with pytest.raises(grpc.aio.AioRpcError) as missing_info:
        await stub.GetModelInfo(info, timeout=TIMEOUT)
    assert missing_info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_list_models_shows_the_one_model_loaded(engine, stub):
    listed = await stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT)
    info = engine.frontend.info
    assert listed.default_model == info.model
    assert [(m.name, m.state, m.pinned) for m in listed.models] == [(info.model, "loaded", True)]
    assert listed.models[0].max_model_len == info.max_model_len


def _fake_frontend(adapters: dict) -> SimpleNamespace:
    return SimpleNamespace(
        info=SimpleNamespace(model="base", max_model_len=64),
        input_processor=SimpleNamespace(loras=SimpleNamespace(get=adapters.get)),
    )


async def test_an_adapter_name_as_model_points_at_lora_name():
    source = OneFrontend(_fake_frontend({"my-adapter": object()}))
    with pytest.raises(ValueError, match="`my-adapter` is a LoRA adapter; name it in lora_name"):
        async with source.hold("my-adapter", None):
            pass
    with pytest.raises(ModelNotFoundError, match=r"`x{256}` does not exist"):
        async with source.hold("x" * 10_000, None):  # the echo of a client's name is bounded
            pass
    async with source.hold("base", None) as frontend:
        assert frontend is source.frontend


async def test_before_the_frontend_is_ready_every_call_is_unavailable():
    source = OneFrontend()
    with pytest.raises(EngineUnavailableError):
        async with source.hold(None, None):
            pass
    with pytest.raises(EngineUnavailableError):
        source.models()
