"""XLM-RoBERTa encoder GGUF files (bge-m3, multilingual-e5: llama.cpp's `bert` architecture with
a SentencePiece Unigram vocabulary, its "t5") embed and tokenize as the folders they were made
from. The folder is a tiny random XLMRobertaModel with a Unigram tokenizer trained here and
built as transformers' XLMRobertaTokenizer builds one (with a small SentencePiece precompiled
charsmap: full-width letters, U+3000, "e" + combining acute); the file is written as
convert_hf_to_gguf.py's XLMRobertaModel writes it from a tokenizer.json folder: pieces, scores
and token types, add_space_prefix / remove_extra_whitespaces / the charsmap, special ids, one
token type, and the position table without its first pad_token_id + 1 rows."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, XLMRobertaConfig, XLMRobertaModel, XLMRobertaTokenizer

from pagestream import LLM
from services.common.gguf_encoders import write_encoder_folder
from tests.helpers.encoder_folders import st_embeddings, write_st_pipeline
from tests.helpers.encoder_gguf import BERT_NAMES, encoder_writer, gguf_name, write_and_close
from tests.helpers.hf_pooling import cosine

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "der schnelle braune Fuchs springt über den faulen Hund",
    "le renard brun rapide saute par-dessus le chien paresseux, café crème",
    "быстрая коричневая лиса прыгает через ленивую собаку",
    "敏捷的棕色狐狸跳过了懒狗",
    "a story about a fox and a dog who were friends for a long time",
]
TEXTS = [
    "the quick brown fox",
    "über den faulen Hund, café",
    "лиса и собака",
    "狐狸跳过了懒狗",
    "ｆｏｘ　fox cafe\u0301",  # the charsmap: full-width letters, U+3000, a combining accent
    "unknown: ✈ ǂ 🙂 ꙮ",  # characters the vocabulary has never seen
    "  spaces\tand\nnewlines   here ",
    "x",
]
PAD = 1  # XLM-R's <s> <pad> </s> <unk>: positions start at pad + 1 = 2


def precompiled_charsmap(table: dict[str, str]) -> bytes:
    """SentencePiece's precompiled normalizer: a darts-clone double array over the UTF-8 of each
    source string (a unit: offset << 10 | has-leaf << 8 | label; a leaf: 1 << 31 | value),
    the array's size in bytes first, then the replacements, NUL-terminated, at the values."""
    blob, values = b"", {}
    for source, target in table.items():
        values[source.encode()] = len(blob)
        blob += target.encode() + b"\0"
    units: dict[int, int] = {}
    next_block = [256]

    def place(pos: int, keys: list[bytes], depth: int) -> None:
        base = next_block[0]
        next_block[0] += 256
        ends = [k for k in keys if len(k) == depth]
        units[pos] = ((pos ^ base) << 10) | (bool(ends) << 8) | units.get(pos, 0)
        if ends:
            units[base] = (1 << 31) | values[ends[0]]
        for byte in sorted({k[depth] for k in keys if len(k) > depth}):
            units[base ^ byte] = byte
            place(base ^ byte, [k for k in keys if len(k) > depth and k[depth] == byte], depth + 1)

    place(0, list(values), 0)
    array = [units.get(i, 0) for i in range(max(units) + 1)]
    trie = struct.pack(f"<{len(array)}I", *array)
    return struct.pack("<I", len(trie)) + trie + blob


CHARSMAP = precompiled_charsmap(
    {"\uff46": "f", "\uff4f": "o", "\uff58": "x", "\u3000": " ", "e\u0301": "\u00e9"}
)


def xlm_roberta_tokenizer() -> XLMRobertaTokenizer:
    """A Unigram vocabulary trained on CORPUS, ids 0-3 <s> <pad> </s> <unk> and <mask> last,
    as XLM-R's are, in transformers' own XLM-R tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    trainer = trainers.UnigramTrainer(
        vocab_size=300, special_tokens=specials, unk_token="<unk>", shrinking_factor=0.9
    )
    trained = Tokenizer(models.Unigram())
    trained.normalizer = normalizers.Precompiled(CHARSMAP)
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trained.train_from_iterator(CORPUS * 8, trainer)
    vocab = json.loads(trained.to_str())["model"]["vocab"]
    vocab = [(piece, 0.0 if piece in specials else score) for piece, score in vocab]
    assert [piece for piece, _ in vocab[:4]] == specials
    return XLMRobertaTokenizer(vocab=[*vocab, ("<mask>", 0.0)], _spm_precompiled_charsmap=CHARSMAP)


def xlm_roberta_folder(tmp_path: Path, pooling: str) -> Path:
    """A sentence-transformers folder: a tiny random XLMRobertaModel (64 positions after the
    padding id), `pooling` and Normalize, as bge-m3 (cls) and multilingual-e5 (mean) are."""
    tokenizer = xlm_roberta_tokenizer()
    torch.manual_seed(0)
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64 + PAD + 1,
        type_vocab_size=1,
        layer_norm_eps=1e-5,
        pad_token_id=PAD,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = XLMRobertaModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # norms and biases away from 1 / 0, so a wrong one shows
        for name, param in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    folder = tmp_path / f"xlm-roberta-{pooling}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    pooling_config = {"word_embedding_dimension": 64, "pooling_mode": pooling}
    write_st_pipeline(folder, pooling_config, normalize=True, max_seq_length=64)
    return folder


def write_xlm_roberta_gguf(
    folder: Path, path: Path, pooling: gguf.PoolingType, mask_filler: bool = False
) -> Path:
    """The folder as convert_hf_to_gguf.py's XLMRobertaModel writes it from tokenizer.json;
    `mask_filler`: as it writes it from sentencepiece.bpe.model (bge-m3's), whose <mask> is
    not a piece: its id holds the converter's "[PAD{i}]" filler, an unused token."""
    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    scores = [
        score for _, score in json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    ]
    offset = config["pad_token_id"] + 1
    context_length = config["max_position_embeddings"] - offset
    writer = encoder_writer(path, "bert", config, pooling, context_length)
    specials = set(tokenizer.all_special_ids)
    tokens, kinds = [], []
    for i in range(config["vocab_size"]):
        tokens.append(tokenizer.convert_ids_to_tokens(i))
        if i == tokenizer.unk_token_id:
            kinds.append(gguf.TokenType.UNKNOWN)
        else:
            kinds.append(gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL)
    if mask_filler:
        mask = tokenizer.mask_token_id
        tokens[mask], kinds[mask], scores[mask] = f"[PAD{mask - 1}]", gguf.TokenType.UNUSED, -1e4
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    writer.add_add_space_prefix(True)
    writer.add_token_type_count(config["type_vocab_size"])
    writer.add_remove_extra_whitespaces(True)
    writer.add_precompiled_charsmap(CHARSMAP)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_sep_token_id(tokenizer.sep_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_mask_token_id(tokenizer.mask_token_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    for name, tensor in load_file(folder / "model.safetensors").items():
        values = tensor.float().numpy()
        if name == "embeddings.position_embeddings.weight":
            values = values[offset:]
        writer.add_tensor(gguf_name(name, BERT_NAMES), values)
    write_and_close(writer)
    return path


@pytest.mark.parametrize("mask_filler", [False, True])
def test_the_tokenizer_written_from_the_file_is_the_folders(tmp_path, mask_filler):
    folder = xlm_roberta_folder(tmp_path, "cls")
    path = write_xlm_roberta_gguf(folder, tmp_path / "m.gguf", gguf.PoolingType.CLS, mask_filler)
    out = tmp_path / "from-gguf"
    out.mkdir()
    write_encoder_folder(path, out)
    expected, got = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(out)
    unknown = got.unk_token_id
    for text in [*TEXTS, "<s>a <mask> fox</s>"]:
        assert got.encode(text) == expected.encode(text), text
    assert got.mask_token_id == expected.mask_token_id
    assert unknown == 3 and unknown in got.encode(TEXTS[5])  # unknown characters: <unk>
    assert unknown not in got.encode("ｆｏｘ") == got.encode("fox")  # the file's charsmap
    pair = got("a fox", "a dog")["input_ids"]
    assert pair == expected("a fox", "a dog")["input_ids"]
    assert got.decode(got.encode(TEXTS[1]), skip_special_tokens=True) == TEXTS[1]
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["pad_token_id"], config["type_vocab_size"]) == (
        "xlm-roberta",
        1,
        1,
    )
    assert config["max_position_embeddings"] == 66


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_an_xlm_roberta_gguf_embeds_as_its_folder(tmp_path, pooling):
    folder = xlm_roberta_folder(tmp_path, pooling)
    expected = st_embeddings(folder, TEXTS)
    kind = gguf.PoolingType.CLS if pooling == "cls" else gguf.PoolingType.MEAN
    path = write_xlm_roberta_gguf(folder, tmp_path / f"{pooling}.gguf", kind)
    llm = LLM(str(path), runner="pooling", dtype="float32", kv_cache_memory="8MiB")
    try:
        got = np.asarray([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        ids = [llm.engine.tokenizer.encode(t) for t in TEXTS]
    finally:
        llm.engine.close()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert ids == [tokenizer.encode(t) for t in TEXTS]
    for g, e in zip(got, expected, strict=True):
        assert cosine(g, e) >= 0.9999
        np.testing.assert_allclose(g, e, atol=1e-4)
