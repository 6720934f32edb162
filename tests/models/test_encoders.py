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
from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaModel

from pagestream import LLM
from services.common.model_errors import ModelLoadError
from tests.helpers.hf_pooling import cosine
from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hi",
    "a story about a fox and a dog who were friends for a long time",
    "dog",
]


def _encoder(arch: str, seed: int):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if arch == "bert":
        model = BertModel(BertConfig(**common, max_position_embeddings=64))
    else:  # positions after the padding id (0 here: the tokenizer pads with <unk>)
        config = XLMRobertaConfig(**common, max_position_embeddings=66, pad_token_id=0)
        model = XLMRobertaModel(config)
    with torch.no_grad():  # norms and biases away from 1 / 0, so a wrong one shows
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def st_folder(tmp_path: Path, arch: str, pooling: str, normalize: bool, seed: int = 0) -> Path:
    """A sentence-transformers folder: the encoder, 1_Pooling, optionally 2_Normalize."""
    folder = tmp_path / f"{arch}-{pooling}-{normalize}"
    _encoder(arch, seed).save_pretrained(folder)
    if arch == "bert":  # BERT's own: WordPiece, [CLS] text [SEP]
        tokenizer = wordpiece_tokenizer()
    else:
        tokenizer = build_tokenizer()
        tokenizer.pad_token = "<unk>"
    tokenizer.save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        normalizer = "sentence_transformers.models.Normalize"
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": normalizer})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling_config = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 60}))
    return folder


def wordpiece_tokenizer():
    """A BERT tokenizer (lower-casing WordPiece; [CLS] a [SEP], pairs [CLS] a [SEP] b [SEP]
    with token types 0 then 1) trained on the test texts: ids 0-4 are [PAD] [UNK] [CLS]
    [SEP] [MASK], as BERT's vocabularies start."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials)
    tokenizer.train_from_iterator(TEXTS * 4, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return BertTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
    )


def st_embeddings(folder: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_numpy=True, batch_size=len(texts))


def _assert_close(got, expected) -> None:
    for g, e in zip(got, expected, strict=True):
        g = np.asarray(g, np.float32)
        assert cosine(g, e) > 0.9999
        np.testing.assert_allclose(g, e, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize(
    ("arch", "pooling", "normalize"),
    [("bert", "mean", True), ("bert", "cls", False), ("xlm-roberta", "mean", False)],
)
@pytest.mark.parametrize("budget", [512, 48])  # all prompts in one step, or few a step
def test_embeddings_equal_sentence_transformers(tmp_path, arch, pooling, normalize, budget):
    folder = st_folder(tmp_path, arch, pooling, normalize)
    expected = st_embeddings(folder, TEXTS)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=budget)
    try:
        assert type(llm.engine.worker.model).__name__ == "BertEncoder"
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


def cross_encoder_folder(tmp_path: Path, arch: str, seed: int = 0) -> Path:
    """A reranker as sentence-transformers' CrossEncoder saves one: a one-label
    *ForSequenceClassification checkpoint with its tokenizer (BERT: pairs as
    [CLS] a [SEP] b [SEP], the second text token type 1)."""
    from transformers import BertForSequenceClassification, XLMRobertaForSequenceClassification

    base = _encoder(arch, seed)
    config = base.config
    config.num_labels = 1
    torch.manual_seed(seed + 1)
    if arch == "bert":
        model = BertForSequenceClassification(config)
        tokenizer = wordpiece_tokenizer()
    else:
        model = XLMRobertaForSequenceClassification(config)
        tokenizer = build_tokenizer()
        tokenizer.pad_token = "<unk>"
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.1 if "LayerNorm" in name else 0.05))
    folder = tmp_path / f"{arch}-reranker"
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
async def test_a_cross_encoder_scores_pairs_as_sentence_transformers_does(tmp_path, arch):
    """A reranker's /v1/score, /rerank and LLM.score equal HF's own forward of the pair
    (AutoModelForSequenceClassification's logit through a sigmoid), and for BERT
    sentence-transformers' CrossEncoder.predict too; its /v1/embeddings is a 400 naming
    the model."""
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tests.helpers.openai_server import MODEL, running_server

    folder = cross_encoder_folder(tmp_path, arch)
    query, documents = TEXTS[3], TEXTS[:3]  # pairs within the tiny models' 64 positions
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = [hf(**tokenizer(query, d, return_tensors="pt")).logits[0, 0] for d in documents]
    expected = torch.sigmoid(torch.stack(logits)).numpy()
    if arch == "bert":  # (sentence-transformers 6's predict differs from HF's own forward
        # for this tiny XLM-RoBERTa by ~0.02; the reference is HF's)
        pairs = [(query, d) for d in documents]
        predicted = CrossEncoder(str(folder), device="cpu").predict(pairs)
        np.testing.assert_allclose(predicted, expected, atol=1e-5)
    assert len(set(np.round(expected, 4))) == 3  # distinct scores: the order is a real test
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
    from transformers import AutoModelForSequenceClassification, BertForSequenceClassification

    base = _encoder("bert", 0)
    base.config.num_labels = 3
    torch.manual_seed(2)
    model = BertForSequenceClassification(base.config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    folder = tmp_path / "classifier"
    model.save_pretrained(folder)
    tokenizer = wordpiece_tokenizer()
    tokenizer.save_pretrained(folder)
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = [hf(**tokenizer(t, return_tensors="pt")).logits[0] for t in TEXTS]
    expected = torch.softmax(torch.stack(logits), dim=-1).numpy()
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
