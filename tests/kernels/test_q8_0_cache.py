"""The q8_0 KV cache (pagestream_kernels/q8_0.py, cpu/q8_0.h): the torch quantizer's
arithmetic, the C++ writer bit-exact with it, and every attention path over a q8_0 cache
(the C++ decode kernel, the native step's row kernel, the torch reference) against float32
attention over the dequantized values (tight) and over the unquantized ones (loose)."""

from __future__ import annotations

import pytest
import torch

from pagestream_kernels import cpu, paged_attention, paged_attention_naive, q8_0, reference
from tests.helpers.paged_attention_batches import MIXED, build_batch, reference_attention
from tests.helpers.q8_0_batches import quantized_batch

TOL = 2e-5  # float32 attention over the same values, summed in another order
# Over the unquantized keys and values (randn, |x| < ~4.5): q8_0 moves each value by at
# most half a step (max|x| / 254 of its group of 32, < ~0.018 here) and each score by the
# query times those; measured worst output error over these batches 0.023 (float32 queries)
# and 0.029 (bfloat16: its output rounding adds ~0.004 |out|), so 0.05 leaves ~1.7x.
UNQUANTIZED_ATOL = 0.05


def test_quantize_is_llama_cpp_arithmetic():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.49, -126.6] + [0.0] * 25)
    x[0, 32:] = 0.0  # an all-zero group: scale 0, codes 0
    x[1] = torch.linspace(-3, 1, 64)
    rows = q8_0.quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (2, q8_0.row_bytes(64)) == (2, 68)
    codes = rows[:, :64].contiguous().view(torch.int8)
    scales = rows[:, 64:].contiguous().view(torch.float16)
    # d = 127 / 127 = 1: ties round away from zero (C's roundf), not to even
    assert codes[0, :7].tolist() == [127, 3, -4, 1, -1, 1, -127]
    assert scales[0].tolist() == [1.0, 0.0] and codes[0, 32:].abs().sum() == 0
    assert codes[1, :32].abs().max() == 127 and codes[1, 32:].abs().max() == 127
    # dequantized: within half a step of the float32 scale, plus the scale's float16 rounding
    d = x.view(2, 2, 32).abs().amax(-1) / 127
    step_error = 0.5 * d + 127 * (d - d.half().float()).abs()
    error = (q8_0.dequantize(rows) - x).abs().view(2, 2, 32).amax(-1)
    assert (error <= step_error * (1 + 1e-6)).all()


def test_head_dims_that_are_no_multiple_of_32_are_refused():
    with pytest.raises(ValueError, match="head_dim is 40"):
        q8_0.quantize(torch.zeros(3, 40))
    with pytest.raises(ValueError, match="no whole number"):
        q8_0.dequantize(torch.zeros(3, 50, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_cpu_cache_write_is_bit_exact_with_the_torch_quantizer(dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, block_size, blocks = 23, 3, 8, 6
    # half steps of a group whose peak is 127 (d = 1): every tie the rounding can meet
    key = torch.randint(-254, 255, (tokens, heads, head_dim), generator=gen) / 2
    key[..., ::32] = 127.0
    value = torch.randn(tokens, heads, head_dim, generator=gen) * 3
    value[5] = 0.0  # all-zero groups
    key, value = key.to(dtype), value.to(dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[4] = -1  # padding: not written
    shape = (2, blocks, block_size, heads, q8_0.row_bytes(head_dim))
    ours, expected = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    cpu.reshape_and_cache(key, value, ours, slots)
    reference.reshape_and_cache(key, value, expected, slots)
    assert torch.equal(ours, expected)
    assert ours.count_nonzero() > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_group_with_a_non_finite_value_reads_back_as_nan(bad):
    """As a float cache would pass a NaN or an infinity on: that group's codes 0 and its
    scale NaN, the C++ writer bit-exact with the torch quantizer, other groups untouched."""
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(4, 2, 64, generator=gen)
    key[1, 0, 40] = bad  # group 1 of head 0 of token 1
    value = key.clone()
    slots = torch.arange(4)
    shape = (2, 1, 4, 2, q8_0.row_bytes(64))
    ours, expected = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    cpu.reshape_and_cache(key, value, ours, slots)
    reference.reshape_and_cache(key, value, expected, slots)
    assert torch.equal(ours, expected)
    back = q8_0.dequantize(ours[0, 0])  # [4, 2, 64]
    assert back[1, 0, 32:].isnan().all()
    assert back[1, 0, :32].isfinite().all() and back[1, 1].isfinite().all()
    assert back[[0, 2, 3]].isfinite().all()
    assert (ours[0, 0, 1, 0, 32:64] == 0).all()  # codes 0


def test_the_cpu_cache_write_refuses_a_row_of_another_width():
    key = torch.zeros(2, 2, 64)
    cache = torch.zeros(2, 1, 4, 2, 64, dtype=torch.uint8)  # float rows' width, not 68
    with pytest.raises(RuntimeError, match="rows of the cache's shape"):
        cpu.reshape_and_cache(key, key, cache, torch.tensor([0, 1]))


def _attention_paths(batch, scale, **kwargs):
    """(name, output) of every path over the batch's cache."""
    yield "cpu", cpu.paged_attention(*batch.args(), scale, **kwargs)
    yield "torch", paged_attention(*batch.args(), scale, **kwargs)
    yield "naive", paged_attention_naive(*batch.args(), scale, **kwargs)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"),
    [(2, 2, 64), (3, 3, 32), (1, 8, 128), (2, 5, 64), (1, 4, 256)],
)
@pytest.mark.parametrize(("sliding_window", "soft_cap"), [(None, None), (8, None), (None, 5.0)])
def test_attention_over_a_q8_0_cache(
    query_dtype, num_kv_heads, group, head_dim, sliding_window, soft_cap
):
    plain = build_batch(MIXED, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, seed=3)
    plain.query = plain.query.to(query_dtype)
    batch = quantized_batch(plain)
    scale = head_dim**-0.5
    kwargs = {"sliding_window": sliding_window, "soft_cap": soft_cap}
    expected = reference_attention(batch, scale, **kwargs)  # float32 over dequantized K/V
    unquantized = reference_attention(plain, scale, **kwargs)
    tol = TOL if query_dtype == torch.float32 else 1e-2  # a bfloat16 output's rounding
    for name, out in _attention_paths(batch, scale, **kwargs):
        assert out.dtype == query_dtype, name
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol, msg=name)
        error = (out.float() - unquantized).abs().max()
        assert error < UNQUANTIZED_ATOL, (name, float(error))


def _rows_of(batch):
    seqs, lens = [], []
    for s, (cached, q_len) in enumerate(batch.specs):
        for t in range(q_len):
            seqs.append(s)
            lens.append(cached + t + 1)
    return torch.tensor(seqs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


# head_dim 512: 16 scales a row, the most the AVX-512 path holds; 576 takes the portable loop
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(2, 2, 64), (1, 8, 32), (1, 2, 512), (1, 3, 576)]
)
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_native_row_attention_over_a_q8_0_cache(num_kv_heads, group, head_dim, sliding_window):
    batch = quantized_batch(
        build_batch(MIXED, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, seed=5)
    )
    row_seq, row_len = _rows_of(batch)
    out = torch.empty_like(batch.query)
    scale = head_dim**-0.5
    cpu.load().paged_attention_rows(
        out, batch.query, batch.kv_cache, batch.block_table, row_seq, row_len, scale,
        sliding_window or 0, 0.0,
    )  # fmt: skip
    expected = reference_attention(batch, scale, sliding_window=sliding_window)
    torch.testing.assert_close(out, expected, atol=TOL, rtol=TOL)


def test_row_attention_refuses_a_cache_row_that_does_not_hold_the_head():
    batch = quantized_batch(build_batch([(5, 1)], num_kv_heads=2, group=2, head_dim=64))
    row_seq, row_len = _rows_of(batch)
    query = torch.zeros(1, 4, 32)  # head_dim 32 against rows of 64 values
    with pytest.raises(RuntimeError, match="must hold the query's head_dim"):
        cpu.load().paged_attention_rows(
            query.clone(), query, batch.kv_cache, batch.block_table, row_seq, row_len, 0.1, 0, 0.0
        )
