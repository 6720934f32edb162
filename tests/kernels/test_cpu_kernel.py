"""pagestream_kernels.cpu (decode groups in C++, built on first use) against the torch references.

The same NaN-poisoned batches as test_reference.py: a stray read of an unwritten slot fails.
The build needs gcc and ninja, which `make setup` provides; a machine without them fails here
rather than silently testing nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagestream_kernels import cpu, paged_attention_naive, reference
from services.worker.layers.attention import resolve_attention_backend
from tests.helpers.paged_attention_batches import MIXED, build_batch, reference_attention

TOL = 2e-5


def _check(batch, sliding_window=None, soft_cap=None) -> None:
    scale = batch.query.shape[-1] ** -0.5
    kwargs = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    ours = cpu.paged_attention(*batch.args(), scale, **kwargs)
    assert ours.dtype == batch.query.dtype and ours.shape == batch.query.shape
    expected = reference_attention(batch, scale, **kwargs)
    torch.testing.assert_close(ours.float(), expected, atol=TOL, rtol=TOL)
    naive = paged_attention_naive(*batch.args(), scale, **kwargs)
    torch.testing.assert_close(ours, naive, atol=TOL, rtol=TOL)


def test_the_kernel_builds_here():
    assert cpu.unavailable_reason() is None


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(2, 1), (3, 3), (1, 8), (2, 4), (2, 6)])
@pytest.mark.parametrize("head_dim", [64, 128, 48, 40])
def test_decode_batch_matches_references(block_size, num_kv_heads, group, head_dim):
    gen = torch.Generator().manual_seed(block_size + group)
    specs = [(int(torch.randint(0, 200, (1,), generator=gen)), 1) for _ in range(13)]
    batch = build_batch(
        specs, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim
    )
    _check(batch)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_references(group):
    _check(build_batch(MIXED, group=group, seed=group))


@pytest.mark.parametrize(
    ("sliding_window", "soft_cap"), [(8, None), (None, 5.0), (20, 2.5), (1, None)]
)
def test_sliding_window_and_soft_cap(sliding_window, soft_cap):
    batch = build_batch(MIXED, group=3, num_kv_heads=3, seed=7)
    _check(batch, sliding_window=sliding_window, soft_cap=soft_cap)


def test_a_pure_decode_step_is_one_kernel_call_without_planning(monkeypatch):
    calls = []
    real = cpu.paged_decode

    def spy(query, *args):
        calls.append(query.shape[0])
        return real(query, *args)

    def no_plans(*args):
        raise AssertionError("a pure decode step was planned")

    monkeypatch.setattr(cpu, "paged_decode", spy)
    monkeypatch.setattr(cpu, "planned_attention", no_plans)
    monkeypatch.setattr(reference, "DECODE_GROUP_TOKENS", 64)  # would cut many groups
    batch = _decode_batch(torch.float32, seed=9)
    out = cpu.paged_attention(*batch.args(), 0.125)
    assert calls == [batch.query.shape[0]]
    torch.testing.assert_close(out, reference_attention(batch, 0.125), atol=TOL, rtol=TOL)


def test_kernel_is_used_for_decode_groups_only(monkeypatch):
    calls = []
    real = cpu.paged_decode

    def spy(query, *args):
        calls.append(query.shape[0])
        return real(query, *args)

    monkeypatch.setattr(cpu, "paged_decode", spy)
    monkeypatch.setattr(reference, "DECODE_GROUP_TOKENS", 10**9)  # one decode group
    batch = build_batch(MIXED, group=2, seed=5)
    _check(batch)
    assert calls == [sum(1 for _, q in MIXED if q == 1)]


# A bfloat16 output is the float32 result rounded once: within half an ulp, 2^-8 of it.
BF16_ROUNDING = 2.0**-8


def _decode_batch(dtype: torch.dtype, seed: int, group: int = 3, head_dim: int = 64):
    gen = torch.Generator().manual_seed(seed)
    specs = [(int(torch.randint(0, 300, (1,), generator=gen)), 1) for _ in range(11)]
    return build_batch(specs, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("head_dim", [64, 40])
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(None, None), (20, 2.5)])
def test_bfloat16_decode_is_the_float32_result_rounded_once(head_dim, sliding_window, soft_cap):
    batch = _decode_batch(torch.bfloat16, seed=head_dim, head_dim=head_dim)
    scale = head_dim**-0.5
    kwargs = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    ours = cpu.paged_attention(*batch.args(), scale, **kwargs)
    assert ours.dtype == torch.bfloat16
    expected = reference_attention(batch, scale, **kwargs)  # float32 over the same bf16 values
    torch.testing.assert_close(ours.float(), expected, atol=1e-6, rtol=BF16_ROUNDING * 1.01)


def test_float32_query_over_a_bfloat16_cache():
    batch = _decode_batch(torch.bfloat16, seed=11)
    batch = dataclasses.replace(batch, query=batch.query.float())
    ours = cpu.paged_attention(*batch.args(), 0.125)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference_attention(batch, 0.125), atol=TOL, rtol=TOL)


def test_the_kernel_takes_float32_and_bfloat16_decode_rows(monkeypatch):
    calls = []
    real = cpu.paged_decode

    def spy(query, kv_cache, *args):
        calls.append((query.dtype, kv_cache.dtype))
        return real(query, kv_cache, *args)

    monkeypatch.setattr(cpu, "paged_decode", spy)
    for dtype in (torch.float32, torch.bfloat16):
        batch = _decode_batch(dtype, seed=3)
        cpu.paged_attention(*batch.args(), 0.125)
    assert calls == [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"), [("bfloat16", "float32"), ("float16", "float16")]
)
def test_other_dtypes_take_the_torch_path(monkeypatch, query_dtype, cache_dtype):
    def refuse(*args):
        raise AssertionError("the C++ kernel got a batch it does not support")

    monkeypatch.setattr(cpu, "paged_decode", refuse)
    batch = build_batch(MIXED, group=2, dtype=getattr(torch, cache_dtype), seed=4)
    batch = dataclasses.replace(batch, query=batch.query.to(getattr(torch, query_dtype)))
    out = cpu.paged_attention(*batch.args(), 0.125)
    torch.testing.assert_close(out.float(), reference_attention(batch, 0.125), atol=3e-2, rtol=3e-2)


def test_auto_backend_on_cpu_is_the_cpu_kernel():
    assert resolve_attention_backend("auto", torch.device("cpu")).name == "cpu"
    assert resolve_attention_backend("torch", torch.device("cpu")).name == "torch"
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_attention_backend("cpu", torch.device("meta"))


def test_out_of_range_block_ids_are_an_error_not_a_stray_read():
    batch = build_batch([(40, 1), (9, 1)], block_size=16, group=2)
    options = reference.AttentionOptions(0.125, None, None)
    query = batch.query.contiguous()
    bad = batch.block_table.clone()
    bad[0, 1] = batch.kv_cache.shape[1] + 5
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.paged_decode(query, batch.kv_cache, bad, batch.seq_lens, options)
    short = batch.seq_lens.clone()
    short[1] = 16 * batch.block_table.shape[1] + 1
    with pytest.raises(RuntimeError, match="more than its block table holds"):
        cpu.paged_decode(query, batch.kv_cache, batch.block_table, short, options)


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path):
    """A process killed mid-build leaves torch's lock file; an old one must not make every
    later worker wait forever, a recent one (a build in progress) must be respected."""
    import os
    import time

    from pagestream_kernels import cpu

    lock = tmp_path / "lock"
    lock.write_text("")
    cpu._clear_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - cpu.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    cpu._clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_built_module_loads_without_the_build_machinery(tmp_path):
    from pagestream_kernels import cpu

    assert cpu._load_built("missing", tmp_path) is None
    (tmp_path / "broken.so").write_bytes(b"not a shared object")
    assert cpu._load_built("broken", tmp_path) is None  # falls back to building


@pytest.mark.parametrize(
    ("src", "dst"), [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")]
)
def test_cache_write_equals_the_reference_on_strided_rows(src, dst):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, dim = 9, 3, 64
    qkv = torch.randn(tokens, (3 + 2 * heads) * dim, generator=gen).to(getattr(torch, src))
    key = qkv[:, 3 * dim : (3 + heads) * dim].view(tokens, heads, dim)  # strided like the model's
    value = qkv[:, (3 + heads) * dim :].view(tokens, heads, dim)
    slots = torch.tensor([5, -1, 0, 17, 3, 30, -1, 8, 12])
    shape = (2, 4, 8, heads, dim)
    ours = torch.full(shape, float("nan"), dtype=getattr(torch, dst))
    expected = ours.clone()
    cpu.reshape_and_cache(key, value, ours, slots)
    reference.reshape_and_cache(key, value, expected, slots)
    assert torch.equal(ours.isnan(), expected.isnan())  # skipped slots stay unwritten
    assert torch.equal(ours.nan_to_num(), expected.nan_to_num())  # same rounding, bit for bit
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.reshape_and_cache(key, value, ours, torch.full((tokens,), 32))


def test_a_strided_query_gives_a_contiguous_output():
    batch = _decode_batch(torch.float32, seed=21)
    wide = torch.cat([batch.query, batch.query], dim=-1)[..., : batch.query.shape[-1]]
    assert not wide.is_contiguous()
    batch = dataclasses.replace(batch, query=wide)
    out = cpu.paged_attention(*batch.args(), 0.125)
    torch.testing.assert_close(out, reference_attention(batch, 0.125), atol=TOL, rtol=TOL)
