"""Tiny random encoders saved as real folders: sentence-transformers bi-encoders (BERT,
XLM-RoBERTa) with their pipeline files, and cross-encoders as CrossEncoder saves them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import (
    BertConfig,
    BertModel,
    ModernBertConfig,
    ModernBertModel,
    MPNetConfig,
    MPNetModel,
    NomicBertConfig,
    NomicBertModel,
    XLMRobertaConfig,
    XLMRobertaModel,
)

from tests.helpers.tiny_tokenizer import VOCAB, build_tokenizer

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hi",
    "a story about a fox and a dog who were friends for a long time",
    "dog",
]


def encoder(arch: str, seed: int):
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
    elif arch == "mpnet":  # positions from 2 (its fixed padding index 1), relative bias
        model = MPNetModel(MPNetConfig(**common, max_position_embeddings=66, pad_token_id=0))
    elif arch == "modernbert":  # layers full, local, local; a window of 4 either side
        config = ModernBertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=96,
            max_position_embeddings=64,
            local_attention=8,
            pad_token_id=0,
            bos_token_id=2,
            cls_token_id=2,
            eos_token_id=3,
            sep_token_id=3,
        )
        model = ModernBertModel(config)
    elif arch == "nomic_bert":  # rotary, SwiGLU, token types
        model = NomicBertModel(NomicBertConfig(**common, max_position_embeddings=64))
    else:  # positions after the padding id (0 here: the tokenizer pads with <unk>)
        config = XLMRobertaConfig(**common, max_position_embeddings=66, pad_token_id=0)
        model = XLMRobertaModel(config)
    with torch.no_grad():  # norms and biases away from 1 / 0, so a wrong one shows
        for name, param in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if "relative_attention_bias" in name:  # ~1 per score, so a wrong bucket shows
                param.normal_(0.0, 1.0)
    return model.eval()


def st_folder(tmp_path: Path, arch: str, pooling: str, normalize: bool, seed: int = 0) -> Path:
    """A sentence-transformers folder: the encoder, 1_Pooling, optionally 2_Normalize."""
    folder = tmp_path / f"{arch}-{pooling}-{normalize}"
    encoder(arch, seed).save_pretrained(folder)
    if arch in ("bert", "mpnet", "modernbert", "nomic_bert"):  # WordPiece, [CLS] text [SEP]
        tokenizer = wordpiece_tokenizer()
        if arch in ("mpnet", "modernbert"):  # no token types
            tokenizer.model_input_names = ["input_ids", "attention_mask"]
    else:
        tokenizer = build_tokenizer()
        tokenizer.pad_token = "<unk>"
    tokenizer.save_pretrained(folder)
    pooling_config = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    write_st_pipeline(folder, pooling_config, normalize, max_seq_length=60)
    return folder


_ST = "sentence_transformers.models."


def write_st_pipeline(
    folder: Path, pooling_config: dict, normalize: bool, max_seq_length: int
) -> None:
    """A sentence-transformers pipeline over the folder's transformer: modules.json,
    1_Pooling with `pooling_config`, optionally 2_Normalize, and max_seq_length."""
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
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST + "Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    config = {"max_seq_length": max_seq_length}
    (folder / "sentence_bert_config.json").write_text(json.dumps(config))


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


def cross_encoder_folder(tmp_path: Path, arch: str, seed: int = 0) -> Path:
    """A reranker as sentence-transformers' CrossEncoder saves one: a one-label
    *ForSequenceClassification checkpoint with its tokenizer (BERT: pairs as
    [CLS] a [SEP] b [SEP], the second text token type 1)."""
    from transformers import (
        BertForSequenceClassification,
        ModernBertForSequenceClassification,
        MPNetForSequenceClassification,
        NomicBertForSequenceClassification,
        XLMRobertaForSequenceClassification,
    )

    base = encoder(arch, seed)
    config = base.config
    config.num_labels = 1
    torch.manual_seed(seed + 1)
    if arch in ("bert", "nomic_bert"):
        kind = (
            BertForSequenceClassification if arch == "bert" else NomicBertForSequenceClassification
        )
        model = kind(config)
        tokenizer = wordpiece_tokenizer()
    elif arch in ("mpnet", "modernbert"):
        if arch == "modernbert":
            config.classifier_pooling = "mean"  # (its other pooling, cls, is BERT's)
        kind = (
            MPNetForSequenceClassification
            if arch == "mpnet"
            else ModernBertForSequenceClassification
        )
        model = kind(config)
        tokenizer = wordpiece_tokenizer()
        tokenizer.model_input_names = ["input_ids", "attention_mask"]
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


def classifier_folder(tmp_path: Path, labels: list[str]) -> Path:
    """A BERT sequence classifier over len(labels) labels, named in its id2label."""
    from transformers import BertForSequenceClassification

    config = encoder("bert", 0).config
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {name: i for i, name in enumerate(labels)}
    torch.manual_seed(2)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    folder = tmp_path / "classifier"
    model.save_pretrained(folder)
    wordpiece_tokenizer().save_pretrained(folder)
    return folder


def hf_label_probabilities(folder: Path, texts: list[str]) -> np.ndarray:
    """HF's own classifier forward of each text, through a softmax over the labels."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = [hf(**tokenizer(t, return_tensors="pt")).logits[0] for t in texts]
    return torch.softmax(torch.stack(logits), dim=-1).numpy()


def hf_pair_scores(folder: Path, query: str, documents: list[str]) -> np.ndarray:
    """HF's own cross-encoder forward of each (query, document) pair through a sigmoid."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = [hf(**tokenizer(query, d, return_tensors="pt")).logits[0, 0] for d in documents]
    return torch.sigmoid(torch.stack(logits)).numpy()


def ranking_cross_encoder(
    tmp_path: Path, arch: str, query: str, documents: list[str]
) -> tuple[Path, np.ndarray]:
    """A cross-encoder whose HF scores of (query, document) are distinct to 1e-4, so an
    order checked against them is a real test, and those scores. The trained WordPiece
    vocabulary's ids can differ between runs (its ties), which moves a random model's
    scores: seeds are tried until one separates them."""
    for seed in range(8):
        folder = cross_encoder_folder(tmp_path / f"seed{seed}", arch, seed)
        scores = hf_pair_scores(folder, query, documents)
        if len(set(np.round(scores, 4))) == len(documents):
            return folder, scores
    raise AssertionError("no seed gave a cross-encoder with distinct scores")
