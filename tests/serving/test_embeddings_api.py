"""Embeddings through the public APIs of a real pooling server (`serve --runner pooling`)
over the tiny llama: the official `openai` client's embeddings.create (every input form,
float and base64) gives HF AutoModel's normalized last-token state; chat requests share
the server (and its steps) with embedding requests; the model card names the runner; bad
input is a 400 naming the field; a generate server refuses embeddings by name. gRPC:
Embed through the stub and through a client that knows the API only by reflection."""

from __future__ import annotations

import asyncio
import base64

import grpc
import numpy as np
import openai
import pytest
import pytest_asyncio

from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.frontend.frontend_server import serve_frontend
from tests.helpers.grpc_calls import reflected_method
from tests.helpers.hf_pooling import cosine, hf_pooled, normalized
from tests.helpers.openai_server import MODEL, TIMEOUT, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

TEXTS = ["Paged attention stores keys", "and values in blocks", "of sixteen tokens each"]
IDS = [5, 17, 33, 99, 250, 12, 8, 41, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]
ENGINE = dict(dtype="float32", runner="pooling", max_num_batched_tokens=8)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(model_dir):
    async with running_server(model_dir("llama"), **ENGINE) as server:
        yield server


def _reference(model_dir, token_ids) -> np.ndarray:
    return normalized(hf_pooled(model_dir("llama"), token_ids, "LAST"))


def _ids_of(server, text: str) -> list[int]:
    return server.engine.frontend.tokenizer.encode(text)


def _assert_embedding(got, ref) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape and cosine(got, ref) > 0.9999
    np.testing.assert_allclose(got, ref, atol=1e-4)


async def test_openai_client_embeds_text_and_token_ids(server, model_dir):
    client = server.async_client()
    result = await client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks base64
    assert [d.index for d in result.data] == [0, 1, 2]
    for text, item in zip(TEXTS, result.data, strict=True):
        _assert_embedding(item.embedding, _reference(model_dir, _ids_of(server, text)))
    lengths = sum(len(_ids_of(server, t)) for t in TEXTS)
    assert result.usage.prompt_tokens == result.usage.total_tokens == lengths
    single = await client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, result.data[0].embedding, atol=1e-6)
    by_ids = await client.embeddings.create(model=MODEL, input=IDS, encoding_format="float")
    _assert_embedding(by_ids.data[0].embedding, _reference(model_dir, IDS))
    batch = await client.embeddings.create(model=MODEL, input=[IDS, IDS[:5]])
    _assert_embedding(batch.data[1].embedding, _reference(model_dir, IDS[:5]))


async def test_base64_is_little_endian_float32(server):
    async with server.raw() as client:
        body = {"model": MODEL, "input": TEXTS[0]}
        floats = (await client.post("/v1/embeddings", json=body)).json()
        packed = (
            await client.post("/v1/embeddings", json={**body, "encoding_format": "base64"})
        ).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats["data"][0]["embedding"], np.float32))
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


async def test_embeddings_and_chat_share_the_server(server, model_dir):
    client = server.async_client()
    chat = [{"role": "user", "content": "Paged attention stores keys"}]
    greedy = dict(model=MODEL, messages=chat, temperature=0, max_tokens=8)
    alone = (await client.chat.completions.create(**greedy)).choices[0].message.content
    results = await asyncio.gather(
        client.chat.completions.create(**greedy),
        *(
            client.embeddings.create(model=MODEL, input=IDS, encoding_format="float")
            for _ in range(4)
        ),
    )
    assert results[0].choices[0].message.content == alone
    for embedding in results[1:]:
        _assert_embedding(embedding.data[0].embedding, _reference(model_dir, IDS))


async def test_the_model_card_names_the_runner(server):
    card = await server.async_client().models.retrieve(MODEL)
    assert card.model_dump()["runner"] == "pooling"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty"),
        ({"input": [[]]}, "input", "empty"),
        ({"input": [5] * 100_000}, "input", "tokens"),
        ({"input": "hi", "dimensions": 8}, "dimensions", "Matryoshka"),
        ({"input": "hi", "dimensions": 0}, "dimensions", "at least 1"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": [3, 9999999]}, "input", "vocabulary"),
        ({"input": ["x"] * 2049}, "input", "--max-prompts"),
    ],
)
async def test_bad_embedding_requests_are_400s_naming_the_field(server, body, param, words):
    async with server.raw() as client:
        response = await client.post("/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"]
    if param is not None and error.get("param") is not None:
        assert error["param"] == param
    # the server serves on
    ok = await server.async_client().embeddings.create(model=MODEL, input="still here")
    assert len(ok.data[0].embedding) == 64


async def test_truncate_prompt_tokens_embeds_the_last_tokens(server, model_dir):
    client = server.async_client()
    long = IDS * 20  # over the context: refused unless truncated
    result = await client.embeddings.create(
        model=MODEL, input=long, extra_body={"truncate_prompt_tokens": 12}
    )
    _assert_embedding(result.data[0].embedding, _reference(model_dir, long[-12:]))
    assert result.usage.prompt_tokens == 12
    with pytest.raises(openai.BadRequestError, match="tokens"):
        await client.embeddings.create(model=MODEL, input=long)
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        await client.embeddings.create(
            model=MODEL, input="hi", extra_body={"truncate_prompt_tokens": 0}
        )


async def test_openai_client_sees_a_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="empty"):
        await server.async_client().embeddings.create(model=MODEL, input="")


async def test_more_inputs_than_the_waiting_bound_are_embedded(model_dir):
    """A request's inputs enter the engine a window at a time (Frontend.encode_many), so
    600 inputs pass a server that refuses new requests while 300 wait."""
    inputs = [[5 + i % 200, 7, 9] for i in range(600)]
    async with running_server(
        model_dir("llama"), runner="pooling", max_waiting_requests=300
    ) as bounded:
        result = await bounded.async_client().embeddings.create(model=MODEL, input=inputs)
    assert [d.index for d in result.data] == list(range(600))
    assert result.usage.prompt_tokens == 1800
    np.testing.assert_allclose(result.data[0].embedding, result.data[200].embedding, atol=1e-6)


async def test_a_generate_server_refuses_embeddings(model_dir):
    async with running_server(model_dir("llama")) as generate:
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            await generate.async_client().embeddings.create(model=MODEL, input="hello")
        card = await generate.async_client().models.retrieve(MODEL)
        assert card.model_dump()["runner"] == "generate"
        handle = await serve_frontend(generate.engine.frontend, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                message = pb.EmbedRequest(inputs=[pb.EmbedInput(text="hello")])
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Embed(message, timeout=TIMEOUT)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "--runner pooling" in err.value.details()
        finally:
            await handle.stop(grace=None)


# ---- gRPC ---------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def grpc_target(server):
    handle = await serve_frontend(server.engine.frontend, "127.0.0.1", 0)
    yield f"127.0.0.1:{handle.port}"
    await handle.stop(grace=None)


async def test_grpc_embed_matches_hf(grpc_target, server, model_dir):
    async with grpc.aio.insecure_channel(grpc_target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        message = pb.EmbedRequest(
            inputs=[
                pb.EmbedInput(text=TEXTS[0]),
                pb.EmbedInput(token_ids=pb.TokenIds(token_ids=IDS)),
            ]
        )
        reply = await stub.Embed(message, timeout=TIMEOUT)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
        bad = pb.EmbedRequest(inputs=[pb.EmbedInput(text="")])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Embed(bad, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in err.value.details()
    assert info.runner == "pooling" and info.capabilities.pooler.pooling_type == "LAST"
    assert reply.request_id and len(reply.embeddings) == 2
    _assert_embedding(reply.embeddings[0].values, _reference(model_dir, _ids_of(server, TEXTS[0])))
    _assert_embedding(reply.embeddings[1].values, _reference(model_dir, IDS))
    assert reply.usage.prompt_tokens == len(_ids_of(server, TEXTS[0])) + len(IDS)


async def test_a_reflection_only_client_embeds(grpc_target, model_dir):
    request_class, response_class = await asyncio.to_thread(reflected_method, grpc_target, "Embed")
    assert request_class is not pb.EmbedRequest  # built from the server's descriptors
    message = request_class()
    message.inputs.add().token_ids.token_ids.extend(IDS)
    message.pooling_params.normalize = False
    async with grpc.aio.insecure_channel(grpc_target) as channel:
        embed = channel.unary_unary(
            "/pagestream.v1.Generation/Embed",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        reply = await embed(message, timeout=TIMEOUT)
    raw = hf_pooled(model_dir("llama"), IDS, "LAST")
    np.testing.assert_allclose(reply.embeddings[0].values, raw, atol=1e-4)
