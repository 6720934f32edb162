"""cpu/quantized_linear.cpp against its torch reference (de-quantize, then a float32
matmul): every code width, scale dtype and group size, with and without mins and bias,
edge shapes (N not a multiple of 16, one column block, one group per row), both few-rows
paths (a float32 model's: codes streamed into float32 FMAs; a bfloat16 model's on a CPU
with VNNI: rows rounded to int8 per block of k, compared with a reference that rounds them
the same way) and the many-rows path (a bfloat16 slice per block for a bfloat16 model
where this CPU has bfloat16 dot products, so compared with bfloat16 inputs). The compact
forms the packing chooses by itself (8-bit codes within -32..31 held as 6 bits; float32
scales that factor as int8 x a float16 per 256 k held in two levels, as the K-quants'
are) give the same weights bit for bit and hold the bytes their source does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagestream_kernels import cpu

FEW_ROWS_FMA, FEW_ROWS_VNNI = 8, 32  # quantized_linear.cpp's streamed rows


def random_codes(n: int, k: int, bits: int, g: torch.Generator, low: int):
    """Codes as QuantizedWeight holds them and their values [N, K]: 8 bits int8 in
    low..-low-1, 4 bits 0..15 packed two a byte (even k in the low nibble)."""
    if bits == 8:
        codes = torch.randint(low, -low, (n, k), generator=g, dtype=torch.int8)
        return codes, codes.float()
    values = torch.randint(0, 16, (n, k), generator=g).float()
    pairs = values.to(torch.uint8).reshape(n, k // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), values


def random_weight(n: int, k: int, bits: int, group: int, scale_dtype, with_mins: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes, values = random_codes(n, k, bits, g, low=-128)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).to(scale_dtype)
    mins = (torch.randn(n, k // group, generator=g) * 0.05).to(scale_dtype) if with_mins else None
    expand = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731
    dense = expand(scales) * values + (expand(mins) if with_mins else 0)
    return codes, scales, mins, dense


def kquant_weight(n: int, k: int, bits: int, group: int, with_mins: bool, seed: int):
    """A weight in a K-quant's structure: float32 scales d * sc_j (d float16 per 256 k, sc_j
    6-bit unsigned with mins -(dmin * m_j), or int8 without mins, as Q4_K / Q5_K and Q6_K
    build them), 4-bit codes 0..15 or 8-bit codes within -32..31 (Q6_K's q - 32)."""
    g = torch.Generator().manual_seed(seed)
    supers, per = k // 256, 256 // group
    d = (torch.rand(n, supers, generator=g) * 1e-3 + 1e-5).half().float()
    if with_mins:
        sub = torch.randint(0, 64, (n, supers, per), generator=g).float()
        sub[0, 0, :] = 0  # an all-zero super-group (and zero mins: -(dmin * 0) is -0.0)
        dmin = (torch.rand(n, supers, generator=g) * 1e-3).half().float()
        m = torch.randint(0, 64, (n, supers, per), generator=g).float()
        m[1 % n, 0, ::2] = 0
        mins = (-(dmin[..., None] * m)).reshape(n, k // group)
    else:
        sub = torch.randint(-128, 128, (n, supers, per), generator=g).float()
        mins = None
    scales = (d[..., None] * sub).reshape(n, k // group)
    codes, values = random_codes(n, k, bits, g, low=-32)
    expand = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731
    dense = expand(scales) * values + (expand(mins) if with_mins else 0)
    return codes, scales, mins, dense


def packed(bits, codes, scales, mins, group, bias, bf16_rows=True):
    module = cpu.load()
    return module.PackedLinear.quantized(
        bits,
        codes,
        scales,
        mins if mins is not None else torch.empty(0),
        group,
        bias if bias is not None else torch.empty(0),
        f"test{bits}",
        bf16_rows,
    )


def bf16_gemm() -> bool:
    return bool(cpu.load().linear_supported(torch.bfloat16))


def vnni() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_vnni" in flags and "avx512f" in flags


def int8_rows_reference(x, dense, mins, group):
    """The VNNI path's arithmetic in torch: x rounded to int8 in blocks of k (x * (127 / max),
    round half to even; the scale max / 127), times the weights without their mins; the mins
    times the exact sums of x."""
    k = x.shape[1]
    block = next(b for b in (32, 16, 8, 4) if group % b == 0)
    blocks = x.reshape(x.shape[0], k // block, block)
    top = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, 127 / torch.where(top > 0, top, 1), 0)
    x_int8 = (torch.round(blocks * inverse) * (top / 127)).reshape_as(x)
    if mins is None:
        return x_int8 @ dense.T
    expanded = mins.float().repeat_interleave(group, dim=1)
    return x_int8 @ (dense - expanded).T + x @ expanded.T


CASES = [
    # bits, n, k, group, scale dtype, mins
    (8, 64, 64, 32, torch.float16, False),  # Q8_0-like
    (4, 40, 96, 32, torch.float16, True),  # Q4_1-like, N not a multiple of 16
    (4, 200, 64, 32, torch.float32, True),  # Q4_K-like (float32 scales), several blocks
    (8, 48, 128, 16, torch.float32, False),  # Q6_K-like
    (8, 100, 96, 32, torch.float32, True),  # Q5_K-like
    (8, 33, 80, 80, torch.float32, False),  # int8 per output channel
    (4, 272, 256, 128, torch.float32, True),  # int4, groups of 128
    (4, 16, 32, 32, torch.float16, False),  # one block, one group per row
    (4, 40, 4608, 32, torch.float32, True),  # K past one de-quantized slice (2048), N partial
    (4, 48, 256, 16, torch.float32, True),  # Q2_K-like: 4 bits in groups of 16 with mins
    (8, 64, 64, 32, torch.float16, True),  # Q5_1-like: 8 bits, float16 scales and mins
]


@pytest.fixture
def stream_rows(request):
    """set_quantized_stream_rows for one test (restored after it)."""
    previous = cpu.load().set_quantized_stream_rows(request.param)
    yield request.param
    cpu.load().set_quantized_stream_rows(previous)


@pytest.mark.parametrize("bits,n,k,group,scale_dtype,with_mins", CASES)
@pytest.mark.parametrize("rows", [1, 3, 5, FEW_ROWS_FMA + 1, 37])
@pytest.mark.parametrize(
    "bf16_rows,stream_rows",
    [(False, -1), (True, -1), (True, 4)],  # -1: the default; 4: more rows de-quantize
    indirect=["stream_rows"],
)
def test_matches_the_dequantized_matmul(
    bits, n, k, group, scale_dtype, with_mins, rows, bf16_rows, stream_rows
):
    codes, scales, mins, dense = random_weight(n, k, bits, group, scale_dtype, with_mins, seed=n)
    g = torch.Generator().manual_seed(rows * 1000 + n)
    bias = torch.randn(n, generator=g) if n % 2 == 0 else None
    x = torch.randn(rows, k, generator=g)
    linear = packed(bits, codes, scales, mins, group, bias, bf16_rows)
    out = linear.forward(x, torch.empty(0), 0)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    vnni_rows = FEW_ROWS_VNNI if stream_rows < 0 else stream_rows
    streamed = vnni_rows if bf16_rows and vnni() else FEW_ROWS_FMA
    if rows <= streamed and bf16_rows and vnni():  # int8 rows, VNNI dot products
        ref = int8_rows_reference(x, dense, mins, group)
    elif rows > streamed and bf16_rows and bf16_gemm():  # blocks de-quantized to bfloat16
        ref = x.bfloat16().float() @ dense.bfloat16().float().T
    else:
        ref = x @ dense.T
    if bias is not None:
        ref = ref + bias
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_rows_and_accounting():
    bits, n, k, group = 4, 72, 64, 32
    codes, scales, mins, dense = random_weight(n, k, bits, group, torch.float16, True, seed=1)
    linear = packed(bits, codes, scales, mins, group, None)
    ids = torch.tensor([0, 5, 71, 64, 5])
    torch.testing.assert_close(linear.gather_rows(ids), dense[ids], rtol=0, atol=0)
    assert (linear.in_features(), linear.out_features()) == (k, n)
    assert linear.format() == "test4"
    # codes (padded to 80 columns) + float16 scales and mins
    assert linear.weight_bytes() >= 80 * k // 2 + 2 * 2 * 80 * (k // group)
    with pytest.raises(RuntimeError, match="row 72 of 72"):
        linear.gather_rows(torch.tensor([72]))


def test_bad_shapes_are_refused():
    codes, scales, _, _ = random_weight(16, 64, 8, 32, torch.float16, False, seed=2)
    with pytest.raises(RuntimeError, match="scales must be"):
        packed(8, codes, scales[:, :1], None, 32, None)
    with pytest.raises(RuntimeError, match="group 24 must divide"):
        packed(8, codes, torch.ones(16, 2, dtype=torch.float16), None, 24, None)
    with pytest.raises(RuntimeError, match="must be uint8"):
        packed(4, codes, scales, None, 32, None)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bf16_rows", [False, True])
@pytest.mark.parametrize("rows", [2, 5, FEW_ROWS_FMA])
def test_rows_do_not_depend_on_the_rows_beside_them(bits, bf16_rows, rows):
    """Within the streamed rows each row's output is bit for bit what it would be alone, so
    a sequence verifying speculative proposals keeps the tokens its decode steps would give."""
    codes, scales, mins, _ = random_weight(256, 128, bits, 32, torch.float16, bits == 4, seed=3)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    linear = packed(bits, codes, scales, mins, 32, None, bf16_rows)
    together = linear.forward(x, torch.empty(0), 0)
    for row in range(rows):
        alone = linear.forward(x[row : row + 1], torch.empty(0), 0)
        assert torch.equal(together[row : row + 1], alone), row


@pytest.mark.parametrize("rows", [1, 5, FEW_ROWS_FMA + 3])
def test_stacked_parts_in_their_own_formats_equal_the_joined_weight(rows):
    """A fused layer whose parts came in different formats (4-bit groups of 32 with mins,
    then 8-bit groups of 16, then 4-bit again; N not a multiple of 16 in the middle): each
    part runs in its own columns, the whole equals the de-quantized weights stacked, bias
    slices included (float32 rows: exact weights, float32 math)."""
    specs = [
        (4, 48, 32, torch.float32, True),
        (8, 24, 16, torch.float32, False),
        (4, 32, 32, torch.float16, True),
    ]
    k = 64
    parts, dense, biases = [], [], []
    for index, (bits, n, group, scale_dtype, with_mins) in enumerate(specs):
        codes, scales, mins, weight = random_weight(
            n, k, bits, group, scale_dtype, with_mins, index
        )
        bias = torch.randn(n, generator=torch.Generator().manual_seed(10 + index))
        parts.append(packed(bits, codes, scales, mins, group, bias, bf16_rows=False))
        dense.append(weight)
        biases.append(bias)
    stacked = cpu.load().PackedLinear.stacked(parts)
    assert stacked.out_features() == 48 + 24 + 32 and stacked.in_features() == k
    assert stacked.weight_bytes() == sum(part.weight_bytes() for part in parts)
    assert stacked.format() == "test4+test8"
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
    expected = x @ torch.cat(dense).T + torch.cat(biases)
    got = stacked.forward(x, torch.empty(0), 0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    ids = torch.tensor([0, 47, 48, 71, 72, 103])
    torch.testing.assert_close(stacked.gather_rows(ids), torch.cat(dense)[ids], atol=1e-6, rtol=0)


KQUANT_CASES = [
    # bits, n, k, group, mins, bytes per weight the packing holds (K-quant: 4.5, 6.56)
    (4, 200, 512, 32, True, (4 + 2 * 8 / 32 + 2 * 16 / 256) / 8),  # Q4_K
    (8, 48, 256, 16, False, (6 + 8 / 16 + 16 / 256) / 8),  # Q6_K
    (8, 100, 256, 32, True, (6 + 2 * 8 / 32 + 2 * 16 / 256) / 8),  # Q5_K
    (8, 64, 2304, 16, False, (6 + 8 / 16 + 16 / 256) / 8),  # Q6_K, K past one slice
    (4, 48, 512, 16, True, (4 + 2 * 8 / 16 + 2 * 16 / 256) / 8),  # Q2_K (codes 0..3 as 4 bits)
]


@pytest.mark.parametrize("bits,n,k,group,with_mins,per_weight", KQUANT_CASES)
@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS_FMA + 1, 37])
@pytest.mark.parametrize("bf16_rows", [False, True])
def test_k_quant_structure_is_held_compact_and_exact(
    bits, n, k, group, with_mins, per_weight, rows, bf16_rows
):
    codes, scales, mins, dense = kquant_weight(n, k, bits, group, with_mins, seed=n + rows)
    linear = packed(bits, codes, scales, mins, group, None, bf16_rows)
    padded = -(-n // 16) * 16
    # the compact bytes (each buffer rounded up to 64 bytes at most), far below the flat
    # form's (8-bit codes, float32 scales: 8 + 32 / group bits a weight)
    compact = padded * k * per_weight
    assert compact <= linear.weight_bytes() <= compact + 5 * 64
    ids = torch.tensor([0, 1, n - 1, n // 2])
    assert torch.equal(linear.gather_rows(ids), dense[ids])  # the same weights, bit for bit
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = linear.forward(x, torch.empty(0), 0)
    if bf16_rows and vnni() and rows <= FEW_ROWS_VNNI:
        ref = int8_rows_reference(x, dense, mins, group)
    elif bf16_rows and bf16_gemm() and rows > FEW_ROWS_VNNI:
        ref = x.bfloat16().float() @ dense.bfloat16().float().T
    else:
        ref = x @ dense.T
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_scales_that_do_not_factor_stay_flat():
    """Float32 scales of no common float16 factor (an online int4 weight's) keep 4 bytes a
    group; 8-bit codes outside -32..31 keep 8 bits."""
    n, k, group = 32, 256, 32
    codes, scales, mins, dense = random_weight(n, k, 4, group, torch.float32, True, seed=5)
    linear = packed(4, codes, scales, mins, group, None)
    assert linear.weight_bytes() >= n * k // 2 + 2 * 4 * n * (k // group)
    # (code * scale + min may be one fused multiply-add here: float32 scales, to 1e-6)
    torch.testing.assert_close(linear.gather_rows(torch.arange(n)), dense, atol=1e-6, rtol=0)
    codes8, scales8, _, dense8 = random_weight(n, k, 8, group, torch.float16, False, seed=6)
    wide = packed(8, codes8, scales8, None, group, None)
    assert wide.weight_bytes() >= n * k + 2 * n * (k // group)
    assert torch.equal(wide.gather_rows(torch.arange(n)), dense8)


def test_six_bit_codes_with_float16_scales():
    """Q8_0-style float16 scales over codes that fit 6 bits: held as 6 bits, same values."""
    n, k, group = 40, 64, 32
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, k // group, generator=g) * 0.02).half()
    dense = scales.float().repeat_interleave(group, dim=1) * codes.float()
    linear = packed(8, codes, scales, None, group, None, bf16_rows=False)
    assert linear.weight_bytes() < 48 * k  # below 8 bits a weight (48: N padded)
    assert torch.equal(linear.gather_rows(torch.arange(n)), dense)
    x = torch.randn(3, k, generator=g)
    torch.testing.assert_close(
        linear.forward(x, torch.empty(0), 0), x @ dense.T, rtol=1e-5, atol=1e-5
    )
