"""The torch paged-attention kernels against a naive loop and an independent SDPA reference.

Every batch is built from contiguous per-sequence keys/values (the ground truth), written into
a NaN-filled cache through shuffled, non-contiguous block tables whose padding points at NaN
blocks, so any stray read of a slot that was never written poisons the result.
"""

from __future__ import annotations

import pytest
import torch

from pagestream_kernels import paged_attention, paged_attention_naive, reference, reshape_and_cache
from tests.helpers.paged_attention_batches import MIXED, Batch, build_batch, reference_attention

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def check_all(
    batch: Batch, sliding_window: int | None = None, soft_cap: float | None = None
) -> None:
    scale = batch.query.shape[-1] ** -0.5
    kwargs = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_attention(batch, scale, **kwargs)
    naive = paged_attention_naive(*batch.args(), scale, **kwargs)
    fast = paged_attention(*batch.args(), scale, **kwargs)
    tol = TOLERANCE[batch.query.dtype]
    assert fast.dtype == batch.query.dtype and fast.shape == batch.query.shape
    torch.testing.assert_close(naive.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(fast.float(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(fast.float(), naive.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_references(block_size: int, group: int, head_dim: int) -> None:
    batch = build_batch(MIXED, block_size=block_size, group=group, head_dim=head_dim, seed=group)
    check_all(batch)


@pytest.mark.parametrize(("block_size", "group"), [(16, 1), (32, 4), (16, 8)])
def test_bfloat16(block_size: int, group: int) -> None:
    batch = build_batch(MIXED, block_size=block_size, group=group, dtype=torch.bfloat16)
    check_all(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("sliding_window", "soft_cap"), [(8, None), (None, 5.0), (20, 2.5), (1, None)]
)
def test_sliding_window_and_soft_cap(
    dtype: torch.dtype, sliding_window: int | None, soft_cap: float | None
) -> None:
    batch = build_batch(MIXED, group=3, num_kv_heads=3, dtype=dtype, seed=7)
    check_all(batch, sliding_window=sliding_window, soft_cap=soft_cap)


@pytest.mark.parametrize(("decode_tokens", "prefill_area"), [(64, 256), (1, 1), (10**9, 10**9)])
def test_grouping_budgets_do_not_change_results(
    monkeypatch: pytest.MonkeyPatch, decode_tokens: int, prefill_area: int
) -> None:
    # Many sequences of varied shapes, split into many groups, one group each, or one group.
    gen = torch.Generator().manual_seed(3)
    specs = [(int(torch.randint(0, 90, (1,), generator=gen)), 1) for _ in range(24)]
    specs += [(0, 3), (0, 5), (9, 4), (0, 30), (50, 12), (2, 2)]
    monkeypatch.setattr(reference, "DECODE_GROUP_TOKENS", decode_tokens)
    monkeypatch.setattr(reference, "PREFILL_GROUP_AREA", prefill_area)
    check_all(build_batch(specs, group=4, seed=11))


def test_decode_only_and_prefill_only_batches_with_hints() -> None:
    for specs in ([(60, 1), (3, 1), (129, 1)], [(0, 40), (17, 9)]):
        batch = build_batch(specs, block_size=32, group=2)
        scale = 0.125
        q_lens = [q for _, q in specs]
        metadata = batch.metadata
        assert (metadata.max_query_len, metadata.max_seq_len) == (
            max(q_lens),
            int(batch.seq_lens.max()),
        )
        hinted = paged_attention(batch.query, batch.kv_cache, metadata, scale)
        torch.testing.assert_close(hinted, reference_attention(batch, scale), atol=2e-5, rtol=0)


def test_query_view_of_fused_qkv_and_float32_query_on_bf16_cache() -> None:
    batch = build_batch(MIXED, group=4, dtype=torch.bfloat16, seed=2)
    num_tokens, num_q_heads, head_dim = batch.query.shape
    qkv = torch.randn(num_tokens, (num_q_heads + 4) * head_dim)  # fused q | k | v projection
    qkv[:, : num_q_heads * head_dim] = batch.query.float().flatten(1)
    query = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    assert not query.is_contiguous()
    args = (query, batch.kv_cache, batch.metadata)
    out = paged_attention(*args, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference_attention(batch, 0.125), atol=1e-5, rtol=1e-5)


def test_heads_must_group_evenly() -> None:
    batch = build_batch([(3, 2)], num_kv_heads=2, group=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(batch.query[:, :3], *batch.args()[1:], 0.125)


def test_single_token_prompt_attends_only_to_itself() -> None:
    batch = build_batch([(0, 1)], group=2)
    out = paged_attention(*batch.args(), 0.1)
    expected = batch.values[0][0].repeat_interleave(2, dim=0)  # softmax over one key = 1
    torch.testing.assert_close(out[0], expected)


def test_reshape_and_cache_writes_slots_and_skips_negative() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(5)
        num_blocks, block_size, heads, head_dim = 6, 16, 3, 64
        kv_cache = torch.full((2, num_blocks, block_size, heads, head_dim), float("nan"))
        kv_cache = kv_cache.to(dtype)
        key = torch.randn(12, heads, head_dim, generator=gen).to(dtype)
        value = torch.randn(12, heads, head_dim, generator=gen).to(dtype)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:12]
        slots[[2, 7]] = -1
        expected = kv_cache.clone()
        for token, slot in enumerate(slots.tolist()):
            if slot >= 0:
                block, offset = divmod(slot, block_size)
                expected[0, block, offset] = key[token]
                expected[1, block, offset] = value[token]
        reshape_and_cache(key, value, kv_cache, slots)
        assert torch.equal(kv_cache.isnan(), expected.isnan())  # skipped rows untouched
        assert kv_cache.isnan().sum() == 2 * heads * head_dim * (num_blocks * block_size - 10)
        assert torch.equal(kv_cache.nan_to_num(0.0), expected.nan_to_num(0.0))


def test_reshape_and_cache_rejects_non_contiguous_cache() -> None:
    kv_cache = torch.zeros(2, 4, 2, 16, 8).transpose(2, 3)  # [2, blocks, 16, 2, 8] strided
    key = torch.ones(1, 2, 8)
    with pytest.raises(RuntimeError):
        reshape_and_cache(key, key, kv_cache, torch.tensor([3]))
