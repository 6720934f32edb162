"""--kv-cache-dtype's names (services/common/kv_cache_dtype.py) from the config to the
worker's cache: q8_0 / int8 as uint8 rows of 34 bytes per 32 values (17/32 of a bfloat16
cache's bytes), fp8 refused off the Triton backend, q8_0 refused on it and for a head_dim
that is no multiple of 32; block moves keep q8_0 blocks whole."""

from __future__ import annotations

import pytest
import torch

from pagestream_kernels import q8_0
from services.common.config import CacheConfig, ModelConfig
from services.common.kv_cache_dtype import KV_CACHE_DTYPES, canonical, check_backend
from services.common.speculative_config import SpeculativeConfig
from services.worker.cache_engine import CacheEngine
from services.worker.models.kv_cache_spec import KVCacheSpec
from services.worker.worker import Worker


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_every_name_is_a_valid_cache_config(name):
    assert CacheConfig(cache_dtype=name).cache_dtype == name


def test_aliases_name_one_layout():
    assert [canonical(n) for n in ("int8", "q8_0", "fp8", "fp8_e4m3", "fp8_e5m2")] == [
        "q8_0",
        "q8_0",
        "fp8_e4m3",
        "fp8_e4m3",
        "fp8_e5m2",
    ]
    assert canonical("bfloat16") == "bfloat16" and canonical("auto") == "auto"


def test_an_unknown_name_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="q8_0"):
        CacheConfig(cache_dtype="q4_0")


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fp8_is_refused_on_the_cpu_backends(name, backend):
    with pytest.raises(ValueError, match=f"--kv-cache-dtype {name} runs on the triton") as info:
        check_backend(name, backend)
    assert "q8_0" in str(info.value)  # the names this backend takes


@pytest.mark.parametrize("name", ["q8_0", "int8"])
def test_q8_0_is_refused_on_triton(name):
    with pytest.raises(ValueError, match="cpu or torch attention backend, not triton"):
        check_backend(name, "triton")


def test_a_q8_0_block_is_17_32_of_a_bfloat16_one():
    bf16 = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    q8 = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=128, dtype=torch.uint8, q8_0=True)
    assert q8.row == q8_0.row_bytes(128) == 136
    assert q8.layer_shape(5, 16) == (2, 5, 16, 2, 136)
    assert q8.bytes_per_block(16) * 32 == bf16.bytes_per_block(16) * 17  # 1.0625 vs 2 bytes
    assert q8.bytes_per_block(16) == 2 * 3 * 16 * 2 * 136


def test_a_q8_0_spec_needs_a_head_dim_of_32s_and_uint8():
    with pytest.raises(ValueError, match="head_dim is 48"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=48, dtype=torch.uint8, q8_0=True)
    with pytest.raises(ValueError, match=r"stored as torch\.uint8"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16, q8_0=True)


def test_block_moves_keep_q8_0_blocks_whole():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.uint8, q8_0=True)
    engine = CacheEngine(spec, block_size=4, num_blocks=6, num_cpu_blocks=3, device="cpu")
    assert (
        engine.kv_caches[0].shape == (2, 6, 4, 2, 68) and engine.kv_caches[0].dtype == torch.uint8
    )
    for cache in engine.kv_caches:
        cache[:, 1] = q8_0.quantize(torch.randn(2, 4, 2, 64))
    block = [cache[:, 1].clone() for cache in engine.kv_caches]
    engine.copy_blocks([(1, 4)])
    engine.swap_out([(4, 2)])
    engine.swap_in([(2, 5)])
    for cache, expected in zip(engine.kv_caches, block, strict=True):
        assert torch.equal(cache[:, 5], expected) and torch.equal(cache[:, 4], expected)


def _worker(folder, cache_dtype: str, **model: object) -> Worker:
    return Worker(
        ModelConfig(model=str(folder), dtype="float32", device="cpu", **model),
        CacheConfig(block_size=4, kv_cache_memory=1 << 20, cache_dtype=cache_dtype),
    )


def test_a_worker_sizes_its_q8_0_cache(tiny_model_dir):
    folder = tiny_model_dir("qwen3")  # head_dim 32
    plain, quantized = _worker(folder, "bfloat16"), _worker(folder, "int8")
    spec = quantized.kv_cache_spec
    assert spec.q8_0 and spec.dtype == torch.uint8 and spec.row == 34
    assert quantized._bytes_per_block() * 32 == plain._bytes_per_block() * 17
    quantized.initialize_cache(16, 4, 64)
    caches = quantized.runner.cache_engine.kv_caches
    assert all(c.dtype == torch.uint8 and c.shape[-1] == 34 for c in caches)


def test_a_worker_refuses_q8_0_for_a_head_dim_of_16(tiny_model_dir):
    with pytest.raises(ValueError, match="head_dim is 16"):
        _worker(tiny_model_dir("llama"), "q8_0")  # 64 / 4 heads


def test_a_cpu_worker_refuses_fp8(tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 runs on the triton"):
        _worker(tiny_model_dir("qwen3"), "fp8", attention_backend="cpu")


def test_a_draft_model_whose_head_dim_q8_0_cannot_hold_fails_the_load(tiny_model_dir):
    draft = SpeculativeConfig(
        method="draft_model", num_speculative_tokens=2, model=str(tiny_model_dir("llama"))
    )
    with pytest.raises(ValueError, match="head_dim is 16"):
        _worker(tiny_model_dir("qwen3"), "q8_0", speculative=draft)
