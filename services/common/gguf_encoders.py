"""llama.cpp's encoder GGUF files (`bert`: BERT, bge, all-MiniLM, e5, and XLM-RoBERTa:
bge-m3, multilingual-e5; `nomic-bert`: nomic-embed-text) as sentence-transformers folders
the native encoders read.

transformers cannot read these files, so the folder is written from the file alone
(`write_encoder_folder` lists what it holds).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from services.common.gguf_unigram import UNIGRAM_MODEL, unigram_tokenizer
from services.common.model_errors import ModelLoadError

ENCODER_ARCHITECTURES = ("bert", "nomic-bert")
_POOLING_MODES = {1: "mean", 2: "cls", 3: "lasttoken"}  # llama.cpp's LLAMA_POOLING_TYPE_*
_CONTROL = 3  # gguf.TokenType.CONTROL
_PHANTOM = "\u2581"

# llama.cpp's names -> HF BertModel's
_BERT_TOP = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_BERT_LAYER = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
# ... and NomicBERT's own (its files' names: what transformers saves too)
_NOMIC_TOP = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "emb_ln",
}
_NOMIC_LAYER = {
    "attn_qkv": "attn.Wqkv",
    "attn_output": "attn.out_proj",
    "attn_output_norm": "norm1",
    "ffn_up": "mlp.fc11",
    "ffn_gate": "mlp.fc12",
    "ffn_down": "mlp.fc2",
    "layer_output_norm": "norm2",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_PATTERN = re.compile(r"(\w+)\.(weight|bias)$")


def write_encoder_folder(gguf_path: Path, out_dir: Path) -> None:
    """The sentence-transformers folder of an encoder GGUF file:

    - config.json: BertConfig / NomicBertConfig from the `{arch}.*` keys;
    - the tokenizer: WordPiece from `tokenizer.ggml.tokens`, undoing llama.cpp's "phantom
      space" spelling (a word-initial piece is stored as "▁piece", a continuation as the bare
      piece: BERT's "##piece"; control tokens as they are), lower-casing as
      `tokenizer.ggml.normalizer.lowercase` says, [CLS] text [SEP] (pairs: [CLS] a [SEP] b
      [SEP], b token type 1) from the file's cls / sep ids; or, for XLM-RoBERTa (a `bert` file
      whose tokenizer is llama.cpp's "t5", a SentencePiece Unigram), services/common/
      gguf_unigram.py's tokenizer.json, and an XLMRobertaConfig whose position table gets back
      the pad_token_id + 1 rows the converter cut off (RoBERTa's positions start after the
      padding id);
    - modules.json, 1_Pooling (`{arch}.pooling_type`: mean, cls or last) and Normalize (what
      llama-server's embeddings return by default);
    - model.safetensors: every tensor de-quantized to float32 (gguf's de-quantizer) under the
      HF checkpoint's names (an encoder is small; the native encoders run float weights).
    """
    from gguf import GGUFReader

    from services.common.gguf_file import GGUFFile

    GGUFFile(gguf_path)  # validated first: GGUFReader trusts the file's header
    reader = GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta["general.architecture"]
    tensors = _tensors(reader, arch)
    if arch == "bert" and meta.get("tokenizer.ggml.model") == UNIGRAM_MODEL:
        config = _xlm_roberta_config(meta, tensors)
        tokenizer = unigram_tokenizer(meta, max_length=int(meta["bert.context_length"]))
    else:
        config = _config(meta, arch, tensors)
        tokenizer = _tokenizer(meta)
    from safetensors.torch import save_file

    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_pipeline(out_dir, meta, arch, config.hidden_size)


def _config(meta: dict, arch: str, tensors: dict):
    """BertConfig / NomicBertConfig from the file's hyperparameters."""
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    words = tensors["embeddings.word_embeddings.weight"].shape[0]
    types = int(meta.get("tokenizer.ggml.token_type_count", 2))
    common = dict(
        vocab_size=words,
        hidden_size=int(key("embedding_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=int(key("attention.head_count")),
        intermediate_size=int(key("feed_forward_length")),
        max_position_embeddings=int(key("context_length")),
        type_vocab_size=types,
        layer_norm_eps=float(key("attention.layer_norm_epsilon", 1e-12)),
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
    )
    if arch == "bert":
        from transformers import BertConfig

        config = BertConfig(**common)
        config.architectures = ["BertModel"]
        return config
    from transformers import NomicBertConfig

    theta = float(key("rope.freq_base", 1000.0))
    config = NomicBertConfig(
        **common, rope_parameters={"rope_type": "default", "rope_theta": theta}
    )
    config.architectures = ["NomicBertModel"]
    return config


def _xlm_roberta_config(meta: dict, tensors: dict):
    """XLMRobertaConfig from a `bert` file with a Unigram vocabulary. llama.cpp's converter
    drops the position table's first pad_token_id + 1 rows (never read: RoBERTa numbers
    positions from pad_token_id + 1) and writes context_length = the rows it keeps; the
    table gets them back as zeros, so HF's XLMRobertaModel indexes it as the checkpoint did."""
    from transformers import XLMRobertaConfig

    pad = int(meta.get("tokenizer.ggml.padding_token_id", 1))
    name = "embeddings.position_embeddings.weight"
    kept = tensors[name]
    tensors[name] = _with_zero_rows(kept, pad + 1)
    config = XLMRobertaConfig(
        vocab_size=tensors["embeddings.word_embeddings.weight"].shape[0],
        hidden_size=int(meta["bert.embedding_length"]),
        num_hidden_layers=int(meta["bert.block_count"]),
        num_attention_heads=int(meta["bert.attention.head_count"]),
        intermediate_size=int(meta["bert.feed_forward_length"]),
        max_position_embeddings=kept.shape[0] + pad + 1,
        type_vocab_size=tensors["embeddings.token_type_embeddings.weight"].shape[0],
        layer_norm_eps=float(meta.get("bert.attention.layer_norm_epsilon", 1e-5)),
        pad_token_id=pad,
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 0)),
        eos_token_id=int(meta.get("tokenizer.ggml.eos_token_id", 2)),
    )
    config.architectures = ["XLMRobertaModel"]
    return config


def _with_zero_rows(table, rows: int):
    """`rows` zero rows, then `table`."""
    import torch

    return torch.cat([table.new_zeros(rows, table.shape[1]), table])


def _tokenizer(meta: dict):
    """The file's WordPiece vocabulary as a BERT tokenizer."""
    if meta.get("tokenizer.ggml.model") != "bert":
        raise ModelLoadError(
            f"an encoder GGUF with tokenizer {meta.get('tokenizer.ggml.model')!r} is not "
            "supported (WordPiece, llama.cpp's 'bert', and, in `bert` files, SentencePiece "
            "Unigram, its 't5', are)"
        )
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    tokens, kinds = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    pieces = [_wordpiece(t, k) for t, k in zip(tokens, kinds, strict=True)]
    vocab = {piece: i for i, piece in reversed(list(enumerate(pieces)))}  # first id wins
    ids = {
        name: int(meta[f"tokenizer.ggml.{key}"])
        for name, key in (
            ("cls", "bos_token_id"),
            ("sep", "seperator_token_id"),
            ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"),
            ("mask", "mask_token_id"),
        )
        if f"tokenizer.ggml.{key}" in meta
    }
    if "sep" not in ids and "tokenizer.ggml.eos_token_id" in meta:
        ids["sep"] = int(meta["tokenizer.ggml.eos_token_id"])
    names = {name: pieces[i] for name, i in ids.items()}
    lowercase = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))
    model = Tokenizer(models.WordPiece(vocab, unk_token=names.get("unk", "[UNK]")))
    model.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    model.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    model.decoder = decoders.WordPiece()
    cls, sep = names["cls"], names["sep"]
    model.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids["cls"]), (sep, ids["sep"])],
    )
    return BertTokenizerFast(
        tokenizer_object=model,
        do_lower_case=lowercase,
        **{f"{name}_token": piece for name, piece in names.items()},
    )


def _wordpiece(token: str, kind: int) -> str:
    """llama.cpp's phantom-space spelling undone."""
    if kind == _CONTROL:
        return token
    return token[1:] if token.startswith(_PHANTOM) else "##" + token


def _tensors(reader, arch: str) -> dict:
    """Every tensor de-quantized to float32 under the HF checkpoint's name."""
    import torch
    from gguf.quants import dequantize

    top, layer = (_BERT_TOP, _BERT_LAYER) if arch == "bert" else (_NOMIC_TOP, _NOMIC_LAYER)
    prefix = "encoder.layer" if arch == "bert" else "encoder.layers"
    out = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, top, layer, prefix)
        if name is None:
            raise ModelLoadError(f"the encoder GGUF's tensor {tensor.name} is not supported")
        values = dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(reversed([int(n) for n in tensor.shape]))  # ggml's ne -> rows first
        out[name] = torch.from_numpy(np.array(values, np.float32).reshape(shape))
    return out


def _hf_name(name: str, top: dict, layer: dict, prefix: str) -> str | None:
    match = _LAYER_PATTERN.match(name)
    if match is not None:
        index, kind, param = match.groups()
        return f"{prefix}.{index}.{layer[kind]}.{param}" if kind in layer else None
    match = _TOP_PATTERN.match(name)
    if match is not None and match.group(1) in top:
        return f"{top[match.group(1)]}.{match.group(2)}"
    return None


def _write_pipeline(out_dir: Path, meta: dict, arch: str, hidden: int) -> None:
    """modules.json, 1_Pooling and Normalize for the file's pooling type."""
    kind = int(meta.get(f"{arch}.pooling_type", 1))
    if kind not in _POOLING_MODES:
        raise ModelLoadError(
            f"the encoder GGUF's pooling_type {kind} is not supported (1 mean, 2 cls, 3 last)"
        )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, "pooling_mode": _POOLING_MODES[kind]}
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
