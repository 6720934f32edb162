"""Scores, reranking, classification and named prompts through every front door of an
encoder server: gRPC Score / Rerank / Classify (the stub, and a client that knows the API
only through reflection) equal HF's own forward as HTTP /v1/score and /rerank do;
/v1/classify gives the label names of the checkpoint's id2label and HF's softmax; a
sentence-transformers folder's named prompts (config_sentence_transformers.json) are put
before the text as SentenceTransformer.encode(prompt_name=...) does, the default one when a
request names none; Matryoshka `dimensions` on an encoder; bad inputs name their field."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from pagestream import LLM
from services.common.proto.pagestream.v1 import generation_pb2 as pb
from services.common.proto.pagestream.v1 import generation_pb2_grpc
from services.frontend.frontend_server import serve_frontend
from tests.helpers.encoder_folders import (
    TEXTS,
    classifier_folder,
    hf_label_probabilities,
    ranking_cross_encoder,
    st_folder,
)
from tests.helpers.grpc_calls import reflected_method
from tests.helpers.hf_pooling import cosine
from tests.helpers.openai_server import MODEL, TIMEOUT, running_server

ENGINE = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=128)
LABELS = ["negative", "neutral", "positive"]
PROMPTS = {"query": "a story about ", "document": "the "}


class grpc_frontend:
    """The server's frontend behind the public gRPC API on port 0, with a stub."""

    def __init__(self, server) -> None:
        self.server = server

    async def __aenter__(self):
        self.handle = await serve_frontend(self.server.engine.frontend, "127.0.0.1", 0)
        self.target = f"127.0.0.1:{self.handle.port}"
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.handle.stop(grace=None)


async def _invalid(call, message) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(message, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.details()


@pytest.mark.asyncio
async def test_grpc_score_and_rerank_with_a_cross_encoder(tmp_path):
    query, documents = TEXTS[3], TEXTS[:3]
    folder, expected = ranking_cross_encoder(tmp_path, "bert", query, documents)
    best_first = list(np.argsort(-expected))
    async with running_server(folder, **ENGINE) as server, grpc_frontend(server) as api:
        scored = await api.stub.Score(
            pb.ScoreRequest(text_1=[query], text_2=documents), timeout=TIMEOUT
        )
        ranked = await api.stub.Rerank(
            pb.RerankRequest(query=query, documents=documents, top_n=2), timeout=TIMEOUT
        )
        bare = await api.stub.Rerank(
            pb.RerankRequest(query=query, documents=documents, return_documents=False),
            timeout=TIMEOUT,
        )
        empty = pb.RerankRequest(query=query, documents=[documents[0], ""])
        assert "documents[1] is empty" in await _invalid(api.stub.Rerank, empty)
        mismatch = pb.ScoreRequest(text_1=documents[:2], text_2=documents)
        assert "text_2" in await _invalid(api.stub.Score, mismatch)
        negative = pb.RerankRequest(query=query, documents=documents, top_n=-1)
        assert "top_n" in await _invalid(api.stub.Rerank, negative)
        request_class, response_class = await asyncio.to_thread(
            reflected_method, api.target, "Rerank"
        )
        message = request_class(query=query)
        message.documents.extend(documents)
        rerank = api.channel.unary_unary(
            "/pagestream.v1.Generation/Rerank",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        reflected = await rerank(message, timeout=TIMEOUT)
    np.testing.assert_allclose(scored.scores, expected, atol=1e-5)
    assert scored.request_id and scored.usage.prompt_tokens > 0
    assert [r.index for r in ranked.results] == best_first[:2]
    for result in ranked.results:
        assert result.document == documents[result.index]
        assert result.relevance_score == pytest.approx(expected[result.index], abs=1e-5)
    assert [r.index for r in bare.results] == best_first and not bare.results[0].document
    assert [r.index for r in reflected.results] == best_first


@pytest.mark.asyncio
async def test_grpc_score_with_an_embedding_model_is_the_cosine(tmp_path):
    from tests.helpers.encoder_folders import st_embeddings

    folder = st_folder(tmp_path, "bert", "mean", True)
    vectors = st_embeddings(folder, TEXTS)
    async with running_server(folder, **ENGINE) as server, grpc_frontend(server) as api:
        scored = await api.stub.Score(
            pb.ScoreRequest(text_1=TEXTS[:2], text_2=TEXTS[2:]), timeout=TIMEOUT
        )
    expected = [cosine(vectors[0], vectors[2]), cosine(vectors[1], vectors[3])]
    np.testing.assert_allclose(scored.scores, expected, atol=1e-5)


@pytest.mark.asyncio
async def test_classify_over_http_and_grpc_names_the_labels(tmp_path):
    folder = classifier_folder(tmp_path, LABELS)
    expected = hf_label_probabilities(folder, TEXTS)
    async with running_server(folder, **ENGINE) as server, server.raw() as http:
        reply = (await http.post("/v1/classify", json={"model": MODEL, "input": TEXTS})).json()
        single = (await http.post("/v1/classify", json={"input": TEXTS[1]})).json()
        empty = await http.post("/v1/classify", json={"input": []})
        scores = await http.post("/v1/score", json={"text_1": "a", "text_2": "b"})
        async with grpc_frontend(server) as api:
            message = pb.ClassifyRequest(inputs=[pb.EmbedInput(text=t) for t in TEXTS])
            classified = await api.stub.Classify(message, timeout=TIMEOUT)
            bad = pb.ClassifyRequest(inputs=[pb.EmbedInput(text="")])
            assert "inputs[0].text is empty" in await _invalid(api.stub.Classify, bad)
    assert reply["object"] == "list" and [d["index"] for d in reply["data"]] == [0, 1, 2, 3]
    for row, data in zip(expected, reply["data"], strict=True):
        np.testing.assert_allclose(data["probs"], row, atol=1e-5)
        assert data["label"] == LABELS[int(np.argmax(row))] and data["num_classes"] == 3
    np.testing.assert_allclose(single["data"][0]["probs"], expected[1], atol=1e-5)
    assert reply["usage"]["prompt_tokens"] > 0
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    assert scores.status_code == 400 and scores.json()["error"]["param"] == "model"
    for row, item in zip(expected, classified.classifications, strict=True):
        np.testing.assert_allclose(item.probs, row, atol=1e-5)
        assert item.label == LABELS[int(np.argmax(row))]


@pytest.mark.asyncio
async def test_an_embedding_model_refuses_classify_by_name(tmp_path):
    folder = st_folder(tmp_path, "bert", "mean", True)
    async with running_server(folder, **ENGINE) as server, server.raw() as http:
        response = await http.post("/v1/classify", json={"input": TEXTS[0]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    assert "classification model" in response.json()["error"]["message"]


def _prompt_folder(tmp_path, default: str | None):
    folder = st_folder(tmp_path, "bert", "mean", True)
    config = {"prompts": PROMPTS, "default_prompt_name": default, "similarity_fn_name": "cosine"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(config))
    return folder


def _st_encode(folder, texts, **kwargs) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=len(texts), **kwargs)


def _assert_close(got, expected) -> None:
    for g, e in zip(got, expected, strict=True):
        assert cosine(np.asarray(g), e) > 0.9999
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-3)


@pytest.mark.asyncio
async def test_named_prompts_are_put_before_the_text(tmp_path):
    folder = _prompt_folder(tmp_path, None)
    plain = _st_encode(folder, TEXTS)
    queries = _st_encode(folder, TEXTS, prompt_name="query")
    documents = _st_encode(folder, TEXTS, prompt_name="document")
    assert cosine(plain[0], queries[0]) < 0.999  # the prompt changes the embedding
    async with running_server(folder, **ENGINE) as server, server.raw() as http:
        got = {}
        for name in (None, "query", "document"):
            body = {"model": MODEL, "input": TEXTS, **({"prompt_name": name} if name else {})}
            reply = (await http.post("/v1/embeddings", json=body)).json()
            got[name] = [d["embedding"] for d in reply["data"]]
        unknown = await http.post("/v1/embeddings", json={"input": "a", "prompt_name": "title"})
        async with grpc_frontend(server) as api:
            message = pb.EmbedRequest(
                inputs=[pb.EmbedInput(text=TEXTS[0])],
                pooling_params=pb.PoolingParams(prompt_name="query"),
            )
            grpc_query = await api.stub.Embed(message, timeout=TIMEOUT)
    _assert_close(got[None], plain)
    _assert_close(got["query"], queries)
    _assert_close(got["document"], documents)
    _assert_close([grpc_query.embeddings[0].values], queries[:1])
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "prompt_name"
    assert "document, query" in unknown.json()["error"]["message"]


def test_the_default_prompt_and_matryoshka_dimensions(tmp_path):
    folder = _prompt_folder(tmp_path, "query")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 64]}))
    defaulted = _st_encode(folder, TEXTS)  # the default prompt, as sentence-transformers does
    documents = _st_encode(folder, TEXTS, prompt_name="document")
    truncated = _st_encode(folder, TEXTS, truncate_dim=16)
    truncated /= np.linalg.norm(truncated, axis=1, keepdims=True)  # vLLM's: cut, normalize
    llm = LLM(str(folder), **ENGINE)
    try:
        got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
        docs = llm.embed(TEXTS, use_tqdm=False, prompt_name="document")
        short = llm.embed(TEXTS, use_tqdm=False, dimensions=16)
        with pytest.raises(ValueError, match="matryoshka_dimensions"):
            llm.embed(TEXTS[:1], use_tqdm=False, dimensions=32)
    finally:
        llm.engine.close()
    _assert_close(got, defaulted)
    _assert_close([o.outputs.embedding for o in docs], documents)
    _assert_close([o.outputs.embedding for o in short], truncated)
