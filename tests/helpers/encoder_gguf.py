"""Encoder GGUF files (llama.cpp's `bert` and `nomic-bert`) written as llama.cpp's
convert_hf_to_gguf.py writes them: its tensor names, hyperparameter keys, "phantom space"
WordPiece vocabulary and special token ids."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
from safetensors.torch import load_file
from transformers import AutoTokenizer

# HF names -> llama.cpp's (its gguf-py tensor_mapping for BERT and NomicBERT)
BERT_NAMES = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
NOMIC_NAMES = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "emb_ln": "token_embd_norm",
    "attn.Wqkv": "attn_qkv",
    "attn.out_proj": "attn_output",
    "norm1": "attn_output_norm",
    "mlp.fc11": "ffn_up",
    "mlp.fc12": "ffn_gate",
    "mlp.fc2": "ffn_down",
    "norm2": "layer_output_norm",
}


def gguf_name(name: str, table: dict) -> str:
    """An HF tensor name under llama.cpp's naming (`table`: BERT_NAMES or NOMIC_NAMES)."""
    module, _, param = name.rpartition(".")
    for prefix in ("encoder.layer.", "encoder.layers."):
        if module.startswith(prefix):
            index, _, rest = module.removeprefix(prefix).partition(".")
            return f"blk.{index}.{table[rest]}.{param}"
    return f"{table[module]}.{param}"


def _phantom(token: str, special: bool) -> str:
    if special:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def encoder_writer(
    path: Path, arch: str, config: dict, pooling: gguf.PoolingType, context_length: int = 0
) -> gguf.GGUFWriter:
    """A GGUFWriter holding an encoder's hyperparameters as the converter writes them
    (`context_length`: the position rows it keeps; 0: max_position_embeddings)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(context_length or config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(pooling)
    return writer


def write_and_close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_encoder_gguf(folder: Path, arch: str, path: Path, quantized: bool) -> Path:
    """The folder's encoder as llama.cpp's convert_hf_to_gguf.py writes it (mean pooling)."""
    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    writer = encoder_writer(path, arch, config, gguf.PoolingType.MEAN)
    if arch == "nomic-bert":
        writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    specials = set(tokenizer.all_special_ids)
    tokens = [_phantom(t, i in specials) for t, i in vocab]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), config["vocab_size"])]
    kinds = [
        gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    writer.add_token_type_count(config.get("type_vocab_size", 2))
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_bos_token_id(tokenizer.cls_token_id)
    writer.add_eos_token_id(tokenizer.sep_token_id)
    writer.add_sep_token_id(tokenizer.sep_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_mask_token_id(tokenizer.mask_token_id)
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", True)
    table = BERT_NAMES if arch == "bert" else NOMIC_NAMES
    for name, tensor in load_file(folder / "model.safetensors").items():
        if "position_ids" in name or name.startswith("pooler."):
            continue
        values = tensor.float().numpy()
        target = gguf_name(name, table)
        if quantized and values.ndim == 2 and "embd" not in target and "types" not in target:
            raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(target, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, values)
    write_and_close(writer)
    return path
