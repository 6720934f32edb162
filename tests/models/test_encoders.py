"""BERT-family encoders through the pooling runner: embeddings equal sentence-transformers'
own on tiny random encoders saved as sentence-transformers folders (BERT, XLM-RoBERTa;
mean and CLS pooling; Normalize on and off), several prompts a step or one, and what the
pipeline cannot run yet refused by name rather than run differently."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagestream import LLM
from services.common.model_errors import ModelLoadError
from services.worker.models.encoder import Encoder
from tests.helpers.encoder_folders import (
    TEXTS,
    classifier_folder,
    hf_label_probabilities,
    ranking_cross_encoder,
    st_embeddings,
    st_folder,
)
from tests.helpers.hf_pooling import cosine


def _assert_close(got, expected) -> None:
    for g, e in zip(got, expected, strict=True):
        g = np.asarray(g, np.float32)
        assert cosine(g, e) > 0.9999
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize(
    ("arch", "pooling", "normalize"),
    [
        ("bert", "mean", True),
        ("bert", "cls", False),
        ("xlm-roberta", "mean", False),
        ("mpnet", "mean", True),
        ("modernbert", "mean", True),
        ("modernbert", "cls", False),
        ("nomic_bert", "mean", True),
    ],
)
@pytest.mark.parametrize("budget", [512, 48])  # all prompts in one step, or few a step
def test_embeddings_equal_sentence_transformers(tmp_path, arch, pooling, normalize, budget):
    folder = st_folder(tmp_path, arch, pooling, normalize)
    expected = st_embeddings(folder, TEXTS)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=budget)
    try:
        assert isinstance(llm.engine.worker.model, Encoder)  # native, not the fallback
        outputs = llm.embed(TEXTS, use_tqdm=False)
    finally:
        llm.engine.close()
    got = [o.outputs.embedding for o in outputs]
    if arch == "bert":  # the prompts as sentence-transformers tokenizes them: [CLS] .. [SEP]
        ids = [o.prompt_token_ids for o in outputs]
        assert all(p[0] == 2 and p[-1] == 3 for p in ids)
    _assert_close(got, expected)
    norms = np.linalg.norm(np.asarray(got), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) == normalize


def test_a_prompt_longer_than_a_step_is_refused_by_name(tmp_path):
    """An encoder's prompt is attended as a whole in one step: one longer than
    max_num_batched_tokens can never run, and says so."""
    folder = st_folder(tmp_path, "bert", "mean", True)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16)
    try:
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            llm.embed([{"prompt_token_ids": list(range(3, 30))}], use_tqdm=False)
        # sentence_bert_config.json's max_seq_length (60) caps the prompt, not the 64 positions
        assert llm.engine.info.max_model_len == 60
        with pytest.raises(ValueError, match="max_model_len=60"):
            llm.embed([{"prompt_token_ids": list(range(3, 64))}], use_tqdm=False)
        assert len(llm.embed(TEXTS[:1], use_tqdm=False)) == 1  # the engine still serves
    finally:
        llm.engine.close()


def st6_folder(tmp_path: Path, pooling: str, dense: bool, normalize: bool) -> Path:
    """A folder as sentence-transformers 6 saves one (its `pooling_mode` string, a Dense
    layer in 2_Dense with its own weights), built from the tiny BERT with its own API."""
    from sentence_transformers import SentenceTransformer, models

    base = st_folder(tmp_path, "bert", "mean", False)
    modules = [models.Transformer(str(base)), models.Pooling(64, pooling_mode=pooling)]
    if dense:
        torch.manual_seed(5)
        modules.append(models.Dense(64, 32, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(models.Normalize())
    folder = tmp_path / f"st6-{pooling}-{dense}-{normalize}"
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


@pytest.mark.parametrize(
    ("pooling", "dense", "normalize"),
    [
        ("weightedmean", True, True),
        ("max", True, False),
        ("cls", False, True),
        ("lasttoken", False, False),
    ],
)
def test_sentence_transformers_6_folders_with_dense_layers(tmp_path, pooling, dense, normalize):
    folder = st6_folder(tmp_path, pooling, dense, normalize)
    expected = st_embeddings(folder, TEXTS)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=48)
    try:
        got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    finally:
        llm.engine.close()
    assert np.asarray(got).shape == expected.shape == (len(TEXTS), 32 if dense else 64)
    _assert_close(got, expected)


def test_pooling_the_pipeline_lacks_is_refused_by_name(tmp_path, model_dir):
    folder = st_folder(tmp_path, "bert", "mean", True)
    config = {"word_embedding_dimension": 64, "pooling_mode_mean_sqrt_len_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mean_sqrt_len"):
        LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")
    # a decoder pools chunk by chunk: no Dense layers after it, no max pooling
    import shutil

    decoder = tmp_path / "decoder"
    shutil.copytree(model_dir("llama"), decoder)
    shutil.copytree(folder / "1_Pooling", decoder / "1_Pooling")
    (decoder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    (decoder / "modules.json").write_text((folder / "modules.json").read_text())
    with pytest.raises(ModelLoadError, match="encoders only"):
        LLM(str(decoder), dtype="float32", kv_cache_memory="8MiB")


async def test_the_openai_client_embeds_with_an_encoder(tmp_path):
    """`serve` on a sentence-transformers BERT folder: the official client's embeddings
    (base64, as the SDK asks) equal sentence-transformers'; a prompt over a step is a 400
    naming the problem and the server serves on."""
    import openai

    from tests.helpers.openai_server import MODEL, running_server

    folder = st_folder(tmp_path, "bert", "mean", True)
    expected = st_embeddings(folder, TEXTS)
    engine = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=48)
    async with running_server(folder, **engine) as server:
        client = server.async_client()
        result = await client.embeddings.create(model=MODEL, input=TEXTS)
        _assert_close([d.embedding for d in result.data], expected)
        with pytest.raises(openai.BadRequestError, match="max_num_batched_tokens"):
            await client.embeddings.create(model=MODEL, input=[list(range(3, 60))])
        again = await client.embeddings.create(model=MODEL, input=TEXTS[:1])
        _assert_close([again.data[0].embedding], expected[:1])


def _cosine_matrix(vectors: np.ndarray) -> np.ndarray:
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return unit @ unit.T


async def test_score_and_rerank_with_an_embedding_model(tmp_path):
    """/v1/score (vLLM's body) and /rerank, /v1/rerank, /v2/rerank (Jina's / Cohere's) over
    a bi-encoder: the cosine of sentence-transformers' embeddings, documents best first;
    bad bodies are 400s naming the field."""
    from tests.helpers.openai_server import MODEL, running_server

    folder = st_folder(tmp_path, "bert", "mean", True)
    query, documents = TEXTS[0], TEXTS[1:]
    cosines = _cosine_matrix(st_embeddings(folder, TEXTS))[0]  # the query against each
    engine = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=48)
    async with running_server(folder, **engine) as server, server.raw() as http:
        body = {"model": MODEL, "text_1": query, "text_2": documents}
        scores = (await http.post("/v1/score", json=body)).json()
        assert [d["index"] for d in scores["data"]] == [0, 1, 2]
        np.testing.assert_allclose([d["score"] for d in scores["data"]], cosines[1:], atol=1e-5)
        assert scores["object"] == "list" and scores["usage"]["prompt_tokens"] > 0
        pairwise = {"model": MODEL, "text_1": documents, "text_2": documents[::-1]}
        pairs = (await http.post("/v1/score", json=pairwise)).json()["data"]
        assert pairs[1]["score"] == pytest.approx(1.0, abs=1e-5)  # the middle text itself
        best_first = sorted(range(3), key=lambda i: -cosines[1 + i])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            body = {"model": MODEL, "query": query, "documents": documents, "top_n": 2}
            ranked = (await http.post(path, json=body)).json()
            assert [r["index"] for r in ranked["results"]] == best_first[:2]
            for result in ranked["results"]:
                assert result["document"]["text"] == documents[result["index"]]
                assert result["relevance_score"] == pytest.approx(
                    cosines[1 + result["index"]], abs=1e-5
                )
        cohere = {
            "query": query,
            "documents": [{"text": d} for d in documents],
            "return_documents": False,
        }
        ranked = (await http.post("/v2/rerank", json=cohere)).json()["results"]
        assert len(ranked) == 3 and all("document" not in r for r in ranked)
        for bad, field in [
            ({"query": query, "documents": []}, "documents"),
            ({"query": "", "documents": documents}, "query"),
            ({"query": query, "documents": documents, "top_n": -1}, "top_n"),
        ]:
            response = await http.post("/v1/rerank", json=bad)
            assert response.status_code == 400 and response.json()["error"]["param"] == field
        mismatch = {"text_1": documents[:2], "text_2": documents}
        response = await http.post("/v1/score", json=mismatch)
        assert response.status_code == 400 and response.json()["error"]["param"] == "text_2"


def test_llm_score_is_the_cosine_of_the_embeddings(tmp_path):
    folder = st_folder(tmp_path, "bert", "cls", False)  # not normalized: score normalizes
    cosines = _cosine_matrix(st_embeddings(folder, TEXTS))
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=48)
    try:
        one_to_many = llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
        pairwise = llm.score(TEXTS[:2], TEXTS[2:], use_tqdm=False)
        with pytest.raises(ValueError, match="text_2"):
            llm.score(TEXTS[:2], TEXTS[1:], use_tqdm=False)
    finally:
        llm.engine.close()
    got = [o.outputs.score for o in one_to_many]
    np.testing.assert_allclose(got, cosines[0, 1:], atol=1e-5)
    got = [o.outputs.score for o in pairwise]
    np.testing.assert_allclose(got, [cosines[0, 2], cosines[1, 3]], atol=1e-5)


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "mpnet", "modernbert", "nomic_bert"])
async def test_a_cross_encoder_scores_pairs_as_sentence_transformers_does(tmp_path, arch):
    """A reranker's /v1/score, /rerank and LLM.score equal HF's own forward of the pair
    (AutoModelForSequenceClassification's logit through a sigmoid), and for BERT
    sentence-transformers' CrossEncoder.predict too; its /v1/embeddings is a 400 naming
    the model."""
    from sentence_transformers import CrossEncoder

    from tests.helpers.openai_server import MODEL, running_server

    query, documents = TEXTS[3], TEXTS[:3]  # pairs within the tiny models' 64 positions
    folder, expected = ranking_cross_encoder(tmp_path, arch, query, documents)
    if arch == "bert":  # (sentence-transformers 6's predict differs from HF's own forward
        # for this tiny XLM-RoBERTa by ~0.02; the reference is HF's)
        pairs = [(query, d) for d in documents]
        predicted = CrossEncoder(str(folder), device="cpu").predict(pairs)
        np.testing.assert_allclose(predicted, expected, atol=1e-5)
    engine = dict(dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=128)
    async with running_server(folder, **engine) as server, server.raw() as http:
        body = {"model": MODEL, "text_1": query, "text_2": documents}
        scores = (await http.post("/v1/score", json=body)).json()["data"]
        np.testing.assert_allclose([d["score"] for d in scores], expected, atol=1e-5)
        ranked = (await http.post("/rerank", json={"query": query, "documents": documents})).json()
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(-expected))
        np.testing.assert_allclose(
            [r["relevance_score"] for r in ranked["results"]], np.sort(expected)[::-1], atol=1e-5
        )
        response = await http.post("/v1/embeddings", json={"model": MODEL, "input": "a fox"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    llm = LLM(str(folder), **engine)
    try:
        got = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    finally:
        llm.engine.close()
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_llm_classify_gives_the_labels_softmax(tmp_path):
    """A three-label BERT classifier: LLM.classify's probabilities are the softmax of HF's
    own logits; an embedding model refuses classify by name."""
    folder = classifier_folder(tmp_path, ["negative", "neutral", "positive"])
    expected = hf_label_probabilities(folder, TEXTS)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=48)
    try:
        got = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
    finally:
        llm.engine.close()
    np.testing.assert_allclose(got, expected, atol=1e-5)
    embedder = LLM(
        str(st_folder(tmp_path, "bert", "mean", True)), dtype="float32", kv_cache_memory="8MiB"
    )
    try:
        with pytest.raises(ValueError, match="classification model"):
            embedder.classify(TEXTS[:1], use_tqdm=False)
    finally:
        embedder.engine.close()


def embedding_gemma_folder(tmp_path: Path, chat_template: bool = False) -> Path:
    """EmbeddingGemma's shape in tiny: a Gemma 3 text model with use_bidirectional_attention
    (windowed and full layers, grouped-query heads), mean pooling, two Dense layers (up and
    back down, no activation) and Normalize, saved by sentence-transformers (6: with a chat
    template its folder says the "message" modality, and encode renders each text as a user
    message through the template)."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import Gemma3TextConfig, Gemma3TextModel

    from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

    torch.manual_seed(7)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,  # bidirectionally: 4 positions either side
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=128,
        use_bidirectional_attention=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Gemma3TextModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    base = tmp_path / "gemma-base"
    model.save_pretrained(base)
    tokenizer = build_tokenizer()
    tokenizer.pad_token = "<unk>"  # (id 0: the config's pad id)
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(base)
    identity = torch.nn.Identity()
    modules = [
        models.Transformer(str(base)),
        models.Pooling(64, pooling_mode="mean"),
        models.Dense(64, 96, bias=False, activation_function=identity),
        models.Dense(96, 64, bias=False, activation_function=identity),
        models.Normalize(),
    ]
    folder = tmp_path / f"embedding-gemma-{chat_template}"
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


@pytest.mark.parametrize(("budget", "chat_template"), [(512, False), (80, False), (512, True)])
def test_a_bidirectional_gemma_embeds_as_sentence_transformers(tmp_path, budget, chat_template):
    """EmbeddingGemma's recipe: the decoder family read bidirectionally (no causal mask,
    windowed layers within half their window either side), equal to sentence-transformers'
    encode (texts longer than the window either side, so a wrong mask shows), with and
    without a named prompt; with a chat template, each text rendered as its message."""
    folder = embedding_gemma_folder(tmp_path, chat_template)
    config_file = folder / "config_sentence_transformers.json"
    config = json.loads(config_file.read_text())
    config["prompts"] = {"query": "task: search result | query: ", "document": ""}
    config_file.write_text(json.dumps(config))
    texts = [*TEXTS, "the fox and the dog were friends " * 3]
    expected = st_embeddings(folder, texts)
    from sentence_transformers import SentenceTransformer

    queries = SentenceTransformer(str(folder), device="cpu").encode(texts, prompt_name="query")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=budget)
    try:
        assert llm.engine.worker.model.bidirectional
        # nothing is kept: one group of one tiny bookkeeping layer, whatever its windows
        assert llm.engine.model_info.kv_cache_groups == (0,)
        assert llm.engine.cache_info.bytes_per_block == 2 * 16 * 4  # K and V, 16 slots, fp32
        got = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
        got_queries = llm.embed(texts, use_tqdm=False, prompt_name="query")
    finally:
        llm.engine.close()
    _assert_close(got, expected)
    _assert_close([o.outputs.embedding for o in got_queries], queries)


def test_an_encoder_holds_only_the_blocks_its_prompts_can_use(tmp_path):
    """The default KV budget in an encoder's tiny bookkeeping blocks would be tens of
    millions of them (seconds and gigabytes to allocate); an encoder holds what
    max_num_seqs prompts at the longest can use, and serves as before."""
    folder = st_folder(tmp_path, "bert", "mean", True)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=8)
    try:
        blocks = llm.engine.cache_info.num_device_blocks
        got = [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]
    finally:
        llm.engine.close()
    assert blocks <= 8 * -(-60 // 16) + 1  # max_seq_length 60, blocks of 16
    _assert_close(got, st_embeddings(folder, TEXTS))


def test_a_prompt_longer_than_the_cpu_prefill_cap_runs_whole(tmp_path):
    """The CPU's default step carries at most 256 tokens of a generating prompt (so
    decodes wait less); an encoder's default step holds its longest prompt instead, so a
    400-token passage of a 512-token model embeds (it was refused) and equals
    sentence-transformers'."""
    from transformers import BertConfig, BertModel

    folder = st_folder(tmp_path, "bert", "mean", True)
    config = BertConfig.from_pretrained(folder)
    config.max_position_embeddings = 512
    torch.manual_seed(1)
    BertModel(config).save_pretrained(folder)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    text = " ".join(TEXTS * 12)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")
    try:
        (out,) = llm.embed([text], use_tqdm=False)
    finally:
        llm.engine.close()
    assert 300 < len(out.prompt_token_ids) <= 512
    _assert_close([out.outputs.embedding], st_embeddings(folder, [text]))
