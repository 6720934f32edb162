"""The native CPU step's kernels (pagestream_kernels/cpu/linear.cpp, paged_decode.cpp's rows entry)
against torch references: the packed GEMM against a float32 matmul of the same rounded
inputs, the row-wise paged attention against the per-sequence SDPA ground truth on the
NaN-poisoned mixed batches of test_reference.py (a stray read of an unwritten slot fails)."""

from __future__ import annotations

import pytest
import torch

from pagestream_kernels import cpu
from tests.helpers.paged_attention_batches import MIXED, build_batch, reference_attention


def _reference_linear(x, weight, bias):
    """float32 x W^T (+ b) on the inputs as the kernel sees them (rounded to the weight's
    dtype), the product accumulated in float64 so the reference's own rounding is nil."""
    out = x.to(weight.dtype).double() @ weight.double().t()
    if bias is not None:
        out += bias.double()
    return out.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 31, 33, 70])
@pytest.mark.parametrize(("out_features", "in_features"), [(40, 24), (208, 64), (1024, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_a_float32_matmul(dtype, rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    linear = cpu.load().PackedLinear(weight, bias if bias is not None else torch.empty(0))
    out = linear.forward(x, torch.empty(0), 0)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    # float32 accumulation over K terms: a few ulps of the sum of |terms|
    scale = (x.to(dtype).float().abs() @ weight.float().abs().t()).max().item()
    torch.testing.assert_close(
        out, _reference_linear(x, weight, bias), atol=1e-6 * scale + 1e-6, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_supported_here(dtype):
    """The CPUs of this project (Zen 4 / Zen 5: AVX-512 with bf16) run both formats."""
    assert cpu.load().linear_supported(dtype)


def _rows_of(batch):
    """Each query row's sequence and causal length, as the native step derives them."""
    seqs, lens = [], []
    for s, (cached, q_len) in enumerate(batch.specs):
        for t in range(q_len):
            seqs.append(s)
            lens.append(cached + t + 1)
    return torch.tensor(seqs, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def _check_rows(batch, scale: float, sliding_window: int | None) -> None:
    """paged_attention_rows on float32 queries against the per-sequence SDPA ground truth
    on the same queries over the cached values."""
    query = batch.query.float().contiguous()
    row_seq, row_len = _rows_of(batch)
    out = torch.empty_like(query)
    cpu.load().paged_attention_rows(
        out,
        query,
        batch.kv_cache,
        batch.block_table,
        row_seq,
        row_len,
        scale,
        sliding_window or 0,
        0.0,
    )
    batch.query = query
    expected = reference_attention(batch, scale, sliding_window=sliding_window)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(2, 2, 64), (3, 3, 64), (1, 8, 40)]
)
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_row_attention_matches_per_sequence_sdpa(
    cache_dtype, num_kv_heads, group, head_dim, sliding_window
):
    batch = build_batch(
        MIXED,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        dtype=cache_dtype,
        seed=group,
    )
    _check_rows(batch, head_dim**-0.5, sliding_window)


def test_row_attention_refuses_a_row_past_its_block_table():
    batch = build_batch([(5, 1), (0, 3)], num_kv_heads=2, group=2)
    row_seq, row_len = _rows_of(batch)
    row_len[0] = 10_000
    out = torch.empty_like(batch.query)
    with pytest.raises(RuntimeError, match="more than its block table holds"):
        cpu.load().paged_attention_rows(
            out, batch.query, batch.kv_cache, batch.block_table, row_seq, row_len, 0.1, 0, 0.0
        )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", [[(700, 1)], [(299, 1), (0, 1)], [(1500, 1)]])
@pytest.mark.parametrize("sliding_window", [None, 300])
def test_long_context_split_across_threads(cache_dtype, specs, sliding_window):
    """Fewer (row, KV head) items than threads: each context is cut into parts attended
    apart and merged (flash-decoding); the result is the same attention."""
    batch = build_batch(specs, num_kv_heads=1, group=4, dtype=cache_dtype, seed=len(specs))
    _check_rows(batch, 0.125, sliding_window)


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_packed_linear_rescores_its_top_outputs_exactly(rows):
    """With the plain weight given, each row's top k outputs are float32 dot products of the
    unrounded row (the LM head's rescoring), the rest the bf16 GEMM's."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 64, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=gen)
    linear = cpu.load().PackedLinear(weight, torch.empty(0))
    plain = linear.forward(x, torch.empty(0), 0)
    rescored = linear.forward(x, weight, 16)
    exact = x.double() @ weight.double().t()
    top = plain.topk(16, dim=-1).indices
    torch.testing.assert_close(
        rescored.gather(1, top), exact.gather(1, top).float(), atol=1e-5, rtol=1e-5
    )
    others = torch.ones_like(plain, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(rescored[others], plain[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 5, 9, 16])
def test_packed_linear_rows_do_not_depend_on_the_rows_beside_them(dtype, rows):
    """Up to 16 rows (decode batches, a sequence verifying speculative proposals) each row's
    output is bit for bit what it would be alone: speculative decoding keeps the tokens of
    a bfloat16 model, whose activations are rounded, only if this holds."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(1024, 96, generator=gen).to(dtype)
    x = torch.randn(rows, 96, generator=gen)
    linear = cpu.load().PackedLinear(weight, torch.empty(0))
    together = linear.forward(x, torch.empty(0), 0)
    for row in range(rows):
        alone = linear.forward(x[row : row + 1], torch.empty(0), 0)
        assert torch.equal(together[row : row + 1], alone), row


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_attention_does_not_depend_on_the_rows_beside_it(cache_dtype):
    """A long context is cut into parts by its own length alone: a decode row gives the same
    bits alone, beside a verification's rows of its own sequence, and in a busy batch."""
    batch = build_batch(
        [(900, 5), (40, 1), (700, 1), (3, 9)], num_kv_heads=2, group=2, dtype=cache_dtype
    )
    query = batch.query.float().contiguous()
    row_seq, row_len = _rows_of(batch)

    def attend(rows: list[int]) -> torch.Tensor:
        out = torch.empty(len(rows), *query.shape[1:])
        cpu.load().paged_attention_rows(
            out,
            query[rows].contiguous(),
            batch.kv_cache,
            batch.block_table,
            row_seq[rows].contiguous(),
            row_len[rows].contiguous(),
            0.125,
            0,
            0.0,
        )
        return out

    everything = attend(list(range(len(row_seq))))
    for row in range(len(row_seq)):
        assert torch.equal(attend([row])[0], everything[row]), row
    assert torch.equal(attend([0, 1, 2, 3, 4]), everything[:5])  # the verification alone
