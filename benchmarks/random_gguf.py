"""Random-block GGUF files with the shapes and tensor types of llama.cpp's Q4_K_M of a real
model, for load-memory and speed benchmarks at size without llama.cpp's tools.

    python -m benchmarks.random_gguf qwen2.5-1.5b
    # -> $PAGESTREAM_CACHE/full_size/qwen2.5-1.5b.random-Q4_K_M.gguf

Shapes from benchmarks/full_size.py's SHAPES, types as llama-quantize's Q4_K_M picks them,
random blocks with small fp16 scales, a byte-level BPE tokenizer padded to the vocabulary.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.full_size import SHAPES, cache_dir, full_config

logger = logging.getLogger(__name__)

ARCHITECTURES = {"qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3"}
# type -> (elements per block, bytes per block, offset of its fp16 scales, their count)
_BLOCKS = {"Q4_K": (256, 144, 0, 2), "Q6_K": (256, 210, 208, 1)}


def _architecture(name: str) -> str | None:
    """The GGUF architecture a shape is written as (None: not one this writer knows)."""
    return ARCHITECTURES.get(SHAPES[name]["model_type"])


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(config: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, torch-order shape, type) of every tensor of `config`'s Q4_K_M file."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    layers = config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    tied = config["tie_word_embeddings"]
    yield "token_embd.weight", (vocab, hidden), "Q6_K" if tied else "Q4_K"
    for i in range(layers):
        more = "Q6_K" if _more_bits(i, layers) else "Q4_K"
        blk = f"blk.{i}"
        yield f"{blk}.attn_norm.weight", (hidden,), "F32"
        yield f"{blk}.attn_q.weight", (q, hidden), "Q4_K"
        yield f"{blk}.attn_k.weight", (kv, hidden), "Q4_K"
        yield f"{blk}.attn_v.weight", (kv, hidden), more
        if config["model_type"] == "qwen2":
            yield from (
                (f"{blk}.attn_{p}.bias", (n,), "F32")
                for p, n in zip("qkv", (q, kv, kv), strict=True)
            )
        if config["model_type"] == "qwen3":
            yield from ((f"{blk}.attn_{p}_norm.weight", (head_dim,), "F32") for p in "qk")
        yield f"{blk}.attn_output.weight", (hidden, q), "Q4_K"
        yield f"{blk}.ffn_norm.weight", (hidden,), "F32"
        yield f"{blk}.ffn_gate.weight", (inter, hidden), "Q4_K"
        yield f"{blk}.ffn_up.weight", (inter, hidden), "Q4_K"
        yield f"{blk}.ffn_down.weight", (hidden, inter), more
    yield "output_norm.weight", (hidden,), "F32"
    if not tied:
        yield "output.weight", (vocab, hidden), "Q6_K"


def _data(shape: tuple[int, ...], type_name: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks (uint8 [rows, row bytes]) with scales in 1e-3..5e-3, or norm weights
    of 1 and biases of 0 for the float tensors."""
    if type_name == "F32":
        return np.ones(shape, np.float32) if len(shape) == 1 else np.zeros(shape, np.float32)
    block, size, start, count = _BLOCKS[type_name]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = (rng.random((rows, cols // block, count)) * 4e-3 + 1e-3).astype(np.float16)
    blocks[..., start : start + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _nbytes(shape: tuple[int, ...], type_name: str) -> int:
    if type_name == "F32":
        return 4 * int(np.prod(shape))
    block, size, _, _ = _BLOCKS[type_name]
    return shape[0] * shape[1] // block * size


def _add_metadata(writer, config: dict) -> None:
    from gguf.constants import LlamaFileType
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer.add_name("random")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    merges = [("Ġ", "t"), ("h", "e")]  # a BPE tokenizer needs at least one
    tokens = ["<unk>", "<s>", "</s>", *bytes_to_unicode().values(), *map("".join, merges)]
    tokens += [f"<extra_{i}>" for i in range(config["vocab_size"] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def write_random_gguf(path: Path, config: dict, seed: int = 0) -> None:
    """`config`'s Q4_K_M-typed file at `path`, one tensor in memory at a time."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), ARCHITECTURES[config["model_type"]])
    _add_metadata(writer, config)
    plan = list(tensor_plan(config))
    for name, shape, type_name in plan:
        raw = None if type_name == "F32" else GGMLQuantizationType[type_name]
        stored = shape if raw is None else (shape[0], _nbytes(shape, type_name) // shape[0])
        dtype = np.dtype(np.float32 if raw is None else np.uint8)
        writer.add_tensor_info(name, stored, dtype, _nbytes(shape, type_name), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shape, type_name in plan:
        writer.write_tensor_data(_data(shape, type_name, rng))
    writer.close()


def random_gguf(name: str) -> Path:
    """`name`'s random Q4_K_M-typed file under $PAGESTREAM_CACHE/full_size, made once."""
    out = cache_dir() / f"{name}.random-Q4_K_M.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    config = full_config(name)
    config.setdefault("tie_word_embeddings", False)
    logger.info("writing %s", out)
    write_random_gguf(tmp, config)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dense = [name for name, shape in SHAPES.items() if "num_experts" not in shape]
    parser.add_argument(
        "shape", choices=[n for n in dense if SHAPES[n]["model_type"] in ARCHITECTURES]
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(random_gguf(args.shape))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
