"""Per-row key limits (AttentionMetadata.key_limits: the tokens of an image a model attends
to both ways see the whole image) in every CPU kernel: the torch reference, its naive
oracle, the cpu backend and the native step's paged_attention_rows, each against a dense
per-sequence SDPA over the ground-truth keys with the limits' mask, on the NaN-poisoned
mixed batches of tests/helpers/paged_attention_batches.py (a stray read fails)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pagestream_kernels import cpu
from pagestream_kernels.reference import paged_attention, paged_attention_naive
from tests.helpers.paged_attention_batches import MIXED, Batch, build_batch


def image_limits(specs: list[tuple[int, int]]) -> torch.Tensor:
    """[T] int32: causal rows, but in each chunk of 3 or more rows a run of rows (from its
    second row; to its end in every other sequence, else one short of it) that see up to
    the run's end."""
    limits = []
    for index, (cached, q_len) in enumerate(specs):
        positions = list(range(cached, cached + q_len))
        row_limits = [p + 1 for p in positions]
        if q_len >= 3:
            first, end = cached + 1, cached + q_len - (index % 2)
            row_limits = [end if first <= p < end else p + 1 for p in positions]
        limits += row_limits
    return torch.tensor(limits, dtype=torch.int32)


def dense_truth(
    batch: Batch, limits: torch.Tensor, scale: float, sliding_window: int | None
) -> torch.Tensor:
    """Per sequence: keys below each row's limit and within its own position's window."""
    outs, start = [], 0
    group = batch.query.shape[1] // batch.keys[0].shape[1]
    for (cached, q_len), k, v in zip(batch.specs, batch.keys, batch.values, strict=True):
        q = batch.query[start : start + q_len].float().transpose(0, 1)  # [q_heads, q_len, hd]
        row_limits = limits[start : start + q_len].long()[:, None]  # [q_len, 1]
        start += q_len
        k = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [q_heads, L, hd]
        v = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = cached + torch.arange(q_len)[:, None]  # [q_len, 1]
        k_pos = torch.arange(k.shape[1])[None, :]  # [1, L]
        mask = k_pos < row_limits
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale))
    return torch.cat([o.transpose(0, 1) for o in outs])  # [T, q_heads, hd]


def limited_batch(sliding_window: int | None, seed: int = 0):
    batch = build_batch(MIXED, num_kv_heads=2, group=3, head_dim=64, seed=seed)
    limits = image_limits(MIXED)
    metadata = dataclasses.replace(batch.metadata, key_limits=limits)
    return batch, limits, metadata, dense_truth(batch, limits, 64**-0.5, sliding_window)


def test_the_limits_change_the_result():
    """The checks below are not vacuous: exactly the widened rows differ from causal ones."""
    batch, limits, _, truth = limited_batch(None)
    causal_limits = torch.cat([torch.arange(c, c + q) + 1 for c, q in MIXED]).int()  # [T]
    causal = dense_truth(batch, causal_limits, 64**-0.5, None)
    differs = (truth - causal).abs().amax(dim=(1, 2)) > 1e-3  # [T]
    widened = limits != causal_limits
    assert widened.sum() > 10 and torch.equal(differs, widened)


@pytest.mark.parametrize("sliding_window", [None, 8])
@pytest.mark.parametrize("kernel", ["torch", "naive", "cpu"])
def test_paged_attention_honours_key_limits(kernel, sliding_window):
    batch, _, metadata, truth = limited_batch(sliding_window, seed=1)
    attend = {"torch": paged_attention, "naive": paged_attention_naive}.get(kernel)
    if attend is None:
        attend = cpu.paged_attention
    out = attend(batch.query, batch.kv_cache, metadata, 64**-0.5, sliding_window=sliding_window)
    torch.testing.assert_close(out, truth, atol=2e-5, rtol=2e-5)


def _rows_of(specs):
    seqs, lens = [], []
    for s, (cached, q_len) in enumerate(specs):
        seqs += [s] * q_len
        lens += range(cached + 1, cached + q_len + 1)
    return torch.tensor(seqs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_native_rows_honour_key_limits(cache_dtype, sliding_window):
    batch = build_batch(MIXED, num_kv_heads=2, group=3, head_dim=64, dtype=cache_dtype, seed=2)
    batch.query = batch.query.float().contiguous()
    limits = image_limits(MIXED)
    row_seq, row_len = _rows_of(MIXED)
    out = torch.empty_like(batch.query)
    cpu.load().paged_attention_rows(
        out,
        batch.query,
        batch.kv_cache,
        batch.block_table,
        row_seq,
        row_len,
        64**-0.5,
        sliding_window or 0,
        0.0,
        limits,
    )
    truth = dense_truth(batch, limits, 64**-0.5, sliding_window)
    torch.testing.assert_close(out, truth, atol=2e-5, rtol=2e-5)


def test_native_rows_refuse_a_limit_below_the_row():
    batch = build_batch([(5, 3)], num_kv_heads=2, group=2)
    row_seq, row_len = _rows_of([(5, 3)])
    limits = row_len.clone()
    limits[1] = 3  # under its causal length 7
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="a limit is at least the length"):
        cpu.load().paged_attention_rows(
            out,
            batch.query,
            batch.kv_cache,
            batch.block_table,
            row_seq,
            row_len,
            0.1,
            0,
            0.0,
            limits,
        )
