"""CacheEngine block moves (bit-exact) and the KV cache sizing math."""

from __future__ import annotations

import pytest
import torch

from services.worker.cache_engine import (
    CacheEngine,
    bytes_per_block,
    num_blocks_for_budget,
    num_blocks_from_profile,
    profile_num_gpu_blocks,
)
from services.worker.models.kv_cache_spec import KVCacheSpec
from tests.helpers.memory import resident_anonymous_bytes

# Same-width integer views, so comparisons are of raw bits (NaN payloads included).
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_engine(dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> CacheEngine:
    engine = CacheEngine(
        KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype),
        block_size=4,
        num_blocks=10,
        num_cpu_blocks=6,
        device=device,
    )
    gen = torch.Generator().manual_seed(seed)
    for cache in engine.kv_caches:  # random bit patterns: every value, NaNs included
        width = 8 * dtype.itemsize
        low, high = -(2 ** (width - 1)), 2 ** (width - 1)
        pattern = torch.randint(low, high, cache.shape, generator=gen, dtype=torch.int64)
        cache.view(BITS[dtype]).copy_(pattern.to(BITS[dtype]))
    return engine


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype]).cpu()


def test_shapes_and_dtype() -> None:
    engine = make_engine(torch.bfloat16)
    assert len(engine.kv_caches) == len(engine.cpu_cache) == 3
    assert all(c.shape == (2, 10, 4, 2, 8) and c.dtype == torch.bfloat16 for c in engine.kv_caches)
    assert all(c.shape == (2, 6, 4, 2, 8) and c.device.type == "cpu" for c in engine.cpu_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_several_pairs(dtype: torch.dtype) -> None:
    engine = make_engine(dtype)
    before = [bits(c).clone() for c in engine.kv_caches]
    pairs = [(0, 5), (3, 7), (9, 2), (3, 8)]
    engine.copy_blocks(pairs)
    for layer, cache in enumerate(engine.kv_caches):
        expected = before[layer].clone()
        for src, dst in pairs:
            expected[:, dst] = before[layer][:, src]
        assert torch.equal(bits(cache), expected)


def test_copy_blocks_reads_sources_before_writing() -> None:
    engine = make_engine(torch.float32)
    before = bits(engine.kv_caches[0]).clone()
    engine.copy_blocks([(1, 2), (2, 3)])  # block 3 gets block 2's old contents
    after = bits(engine.kv_caches[0])
    assert torch.equal(after[:, 2], before[:, 1]) and torch.equal(after[:, 3], before[:, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swap_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    engine = make_engine(dtype)
    before = [bits(c).clone() for c in engine.kv_caches]
    cpu_before = [bits(c).clone() for c in engine.cpu_cache]  # uninitialised: only ever written
    engine.swap_out([(4, 0), (7, 5), (1, 3)])
    for layer, cpu in enumerate(engine.cpu_cache):
        assert torch.equal(bits(cpu)[:, [0, 5, 3]], before[layer][:, [4, 7, 1]])
        assert torch.equal(bits(cpu)[:, [1, 2, 4]], cpu_before[layer][:, [1, 2, 4]])  # untouched
    for cache in engine.kv_caches:  # the device blocks get reused by someone else
        cache[:, [4, 7, 1]] = 0
    engine.swap_in([(0, 8), (5, 9), (3, 4)])
    for layer, cache in enumerate(engine.kv_caches):
        assert torch.equal(bits(cache)[:, [8, 9, 4]], before[layer][:, [4, 7, 1]])
        assert torch.equal(bits(cache)[:, [0, 2, 3, 5, 6]], before[layer][:, [0, 2, 3, 5, 6]])


def test_empty_pairs_change_nothing() -> None:
    engine = make_engine(torch.float32)
    before = [bits(c).clone() for c in engine.kv_caches]
    engine.copy_blocks([])
    engine.swap_out([])
    engine.swap_in([])
    assert all(torch.equal(bits(c), b) for c, b in zip(engine.kv_caches, before, strict=True))


def test_out_of_range_block_ids_are_clear_errors() -> None:
    engine = make_engine(torch.float32)
    with pytest.raises(ValueError, match=r"copy_blocks target block ids \[10\]"):
        engine.copy_blocks([(0, 10)])
    with pytest.raises(ValueError, match="swap_out CPU block ids"):
        engine.swap_out([(0, 6)])
    with pytest.raises(ValueError, match="swap_in device block ids"):
        engine.swap_in([(0, -1)])


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        CacheEngine(KVCacheSpec(2, 2, 8, torch.float32), 16, 0, 0, "cpu")
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        CacheEngine(KVCacheSpec(2, 2, 8, torch.float32), 16, 4, -1, "cpu")


def test_bytes_per_block_formula_and_tensor_size() -> None:
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, bf16, block 16.
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2 == 368640
    assert bytes_per_block(2, 32, 8, 128, torch.float32) == 2 * 2 * 32 * 8 * 128 * 4
    engine = make_engine(torch.float16)
    per_block = sum(c[:, 0].nbytes for c in engine.kv_caches)
    assert per_block == bytes_per_block(3, 4, 2, 8, torch.float16)


def test_num_blocks_for_budget() -> None:
    per_block = bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert num_blocks_for_budget(4 * 1024**3, per_block) == 4 * 1024**3 // 368640 == 11650
    assert num_blocks_for_budget(per_block * 7, per_block) == 7
    assert num_blocks_for_budget(per_block * 8 - 1, per_block) == 7
    assert num_blocks_for_budget(per_block, per_block) == 1


@pytest.mark.parametrize("budget", [0, 1, 368639])
def test_budget_too_small_is_a_clear_error(budget: int) -> None:
    with pytest.raises(ValueError, match=r"holds no KV block of 368640 bytes.*--kv-cache-memory"):
        num_blocks_for_budget(budget, 368640)


def test_num_blocks_from_profile() -> None:
    gib = 1024**3
    assert num_blocks_from_profile(80 * gib, 0.9, 10 * gib, gib // 2) == (72 - 10) * 2
    assert num_blocks_from_profile(1000, 0.5, 100, 100) == 4
    with pytest.raises(ValueError, match=r"peak use is already 80\.00 GiB"):
        num_blocks_from_profile(80 * gib, 0.9, 80 * gib, 1024)


def test_profile_needs_cuda() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        profile_num_gpu_blocks(lambda: None, 1024, 0.9, "cpu")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_swap_round_trip_pinned(dtype: torch.dtype) -> None:
    engine = make_engine(dtype, device="cuda")
    assert all(c.is_pinned() for c in engine.cpu_cache)
    before = [bits(c).clone() for c in engine.kv_caches]
    engine.swap_out([(2, 1), (6, 0)])
    engine.copy_blocks([(0, 2), (1, 6)])
    engine.swap_in([(1, 3), (0, 9)])
    for layer, cache in enumerate(engine.kv_caches):
        assert torch.equal(bits(cache)[:, [3, 9]], before[layer][:, [2, 6]])
        assert torch.equal(bits(cache)[:, [2, 6]], before[layer][:, [0, 1]])


@pytest.mark.gpu
@needs_cuda
def test_cuda_profile_counts_the_forward_peak() -> None:
    gib = 1024**3

    def dummy_forward() -> None:
        scratch = torch.empty(2 * gib, dtype=torch.uint8, device="cuda")  # transient 2 GiB
        del scratch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    per_block = 64 * 1024**2
    num_blocks = profile_num_gpu_blocks(dummy_forward, per_block, 0.5, "cuda")
    used_before = total - free
    expected = (int(total * 0.5) - used_before - 2 * gib) // per_block
    assert abs(num_blocks - expected) <= 2  # the allocator may round a little


def test_the_cpu_cache_becomes_resident_as_its_blocks_are_used():
    """A 1 GiB cache costs (almost) nothing until written, reads as zeros, and a written
    block costs its own pages only (Linux: RssAnon)."""
    before = resident_anonymous_bytes()
    engine = CacheEngine(
        KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float32),
        block_size=16,
        num_blocks=8192,
        num_cpu_blocks=0,
        device="cpu",
    )  # 4 layers x 8192 blocks x (K and V: 2 x 16 tokens x 4 heads x 64 x 4 bytes) = 1 GiB
    total = sum(cache.nbytes for cache in engine.kv_caches)
    assert total == 1 << 30
    assert resident_anonymous_bytes() - before < 64 << 20
    block = engine.kv_caches[0][:, 7]  # [2, block_size, heads, head_dim]
    assert not block.any()  # zero-filled, never stale bit patterns
    for cache in engine.kv_caches:
        cache[:, :16] = 1.0  # 16 blocks of every layer in use: 4 x 16 x 32 KiB = 2 MiB
    assert resident_anonymous_bytes() - before < 64 << 20
    assert float(engine.kv_caches[3][1, 15].sum()) == 16 * 4 * 64
