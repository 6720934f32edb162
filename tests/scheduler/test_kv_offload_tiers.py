"""offload_index_for: when an engine core gets KV offload tiers, and their bounds in blocks."""

import logging
from dataclasses import replace

from services.common import kv_block_file
from services.common.config import CacheConfig, ModelConfig
from services.common.worker_info import CacheInfo, ModelInfo
from services.scheduler.kv_offload_tiers import offload_index_for

MODEL = ModelInfo(
    model="m",
    architecture="LlamaForCausalLM",
    dtype="float32",
    device="cpu",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    vocab_size=64,
    eos_token_ids=(0,),
    max_model_len=128,
)
CACHE = CacheInfo(num_device_blocks=32, num_cpu_blocks=0, block_size=4, bytes_per_block=1000)
HOST = CacheConfig(block_size=4, enable_prefix_caching=True, kv_offload_host_bytes=10_500)


def _index(cache_config: CacheConfig, model: ModelInfo = MODEL, model_path: str = "/nowhere"):
    return offload_index_for(ModelConfig(model=model_path), cache_config, CACHE, model)


def test_each_tier_holds_its_bytes_over_a_blocks():
    index = _index(HOST)
    assert index is not None and {n: lru.capacity for n, lru in index.tiers.items()} == {"host": 10}


def test_the_disk_tier_counts_each_files_header(tmp_path, caplog):
    per_file = kv_block_file.HEADER_BYTES + CACHE.bytes_per_block
    config = replace(HOST, kv_offload_dir=str(tmp_path), kv_offload_bytes=3 * per_file + 1)
    with caplog.at_level(logging.WARNING):
        index = _index(config)  # a model whose files are not here: no scan, tiers still on
    assert index is not None and index.tiers["disk"].capacity == 3
    assert "not scanning" in caplog.text


def test_no_tier_asked_for_is_none():
    assert _index(CacheConfig(enable_prefix_caching=True)) is None


def test_unsupported_layouts_run_without_tiers_and_say_why(caplog):
    cases = {
        "prefix caching is off": (replace(HOST, enable_prefix_caching=False), MODEL),
        "sliding window": (replace(HOST, kv_cache_groups=(0, 16)), MODEL),
        "2 ranks": (HOST, replace(MODEL, world_size=2, tensor_parallel_size=2)),
        "hold no block": (replace(HOST, kv_offload_host_bytes=999), MODEL),
    }
    for reason, (config, model) in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert _index(config, model) is None
        assert reason in caplog.text
