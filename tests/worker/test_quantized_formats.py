"""QuantizedWeight: GGUF block decoding against gguf's reference dequantizer, exact narrowing
and concatenation, and the online int8 / int4 quantizers' error bounds."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

from services.worker.layers.quantization import (
    GGUF_BLOCK_TYPES,
    QuantizedWeight,
    UnsupportedQuantization,
    cat_rows,
    decode_gguf,
    gguf_float,
    online,
    quantize_int4,
    quantize_int8,
)

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1")  # gguf.quants.quantize implements these
# where each block's fp16 fields lie: (byte offset, count)
FP16_FIELDS = {
    "Q8_0": (0, 1),
    "Q4_0": (0, 1),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, 1),
    "Q5_0": (0, 1),
    "Q5_1": (0, 2),
    "IQ4_NL": (0, 1),
    "Q2_K": (80, 2),
    "Q3_K": (108, 1),
    "IQ4_XS": (0, 1),
}


def _qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def _random_raw(name: str, n: int, k: int, seed: int, quantized: bool = True) -> np.ndarray:
    """uint8 [N, bytes_per_row]: gguf's quantization of random floats where it has one,
    else random bytes with real (finite) fp16 fields."""
    rng = np.random.default_rng(seed)
    if quantized and name in QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32), _qtype(name))
    block, size = gguf.GGML_QUANT_SIZES[_qtype(name)]
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    start, count = FP16_FIELDS[name]
    fields = (rng.standard_normal((n, k // block, count)) * 0.02).astype(np.float16)
    blocks[..., start : start + 2 * count] = fields.view(np.uint8)
    return blocks.reshape(n, -1)


def _reference(raw: np.ndarray, name: str) -> np.ndarray:
    return gguf.quants.dequantize(raw, _qtype(name))


def _weight(name: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    return decode_gguf(_random_raw(name, n, k, seed, quantized=False), name, k)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (-0.0 and 0.0 differ), float32."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(
        a.view(torch.int32), b.view(torch.int32)
    )


# --- GGUF blocks --------------------------------------------------------------------------


def test_supported_types_are_the_common_mixes_block_formats():
    assert set(GGUF_BLOCK_TYPES) == {
        *("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"),
        *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"),
    }


@pytest.mark.parametrize(
    "name, quantized",
    [(name, True) for name in GGUF_BLOCK_TYPES] + [(name, False) for name in QUANTIZABLE],
)
@pytest.mark.parametrize("n, k", [(1, 256), (7, 512), (33, 768), (16, 256)])
def test_decode_matches_ggufs_dequantize_exactly(name, n, k, quantized):
    """quantized: gguf's quantization of random floats (K-quants: random bytes, always);
    else random bytes (negative d, every code) with finite fp16 fields."""
    raw = _random_raw(name, n, k, seed=n * k, quantized=quantized)
    qw = decode_gguf(raw, name, k)
    assert qw.shape == (n, k) and qw.source == name
    np.testing.assert_array_equal(qw.dequantize().numpy(), _reference(raw, name))


@pytest.mark.parametrize(
    "name, bits, group, scale_dtype, has_mins",
    [
        ("Q8_0", 8, 32, torch.float16, False),
        ("Q4_0", 4, 32, torch.float16, True),
        ("Q4_1", 4, 32, torch.float16, True),
        ("Q4_K", 4, 32, torch.float32, True),
        ("Q5_K", 8, 32, torch.float32, True),
        ("Q6_K", 8, 16, torch.float32, False),
        ("Q5_0", 8, 32, torch.float16, False),
        ("Q5_1", 8, 32, torch.float16, True),
        ("IQ4_NL", 8, 32, torch.float16, False),
        ("Q2_K", 4, 16, torch.float32, True),
        ("Q3_K", 8, 16, torch.float32, False),
        ("IQ4_XS", 8, 32, torch.float32, False),
    ],
)
def test_decoded_form(name, bits, group, scale_dtype, has_mins):
    qw = _weight(name, 3, 512)
    assert (qw.bits, qw.group_size, qw.scales.dtype) == (bits, group, scale_dtype)
    assert (qw.mins is not None) == has_mins
    codes = qw.unpacked_codes()
    low, high = {
        "Q8_0": (-128, 127),
        "Q5_K": (0, 31),
        "Q6_K": (-32, 31),
        "Q5_0": (-16, 15),
        "Q5_1": (0, 31),
        "IQ4_NL": (-127, 113),
        "Q2_K": (0, 3),
        "Q3_K": (-4, 3),
        "IQ4_XS": (-127, 113),
    }.get(name, (0, 15))
    assert low <= codes.min() and codes.max() <= high
    assert codes.min() == low and codes.max() == high  # random bytes reach every code


@pytest.mark.parametrize("k", [32, 96])
@pytest.mark.parametrize("name", QUANTIZABLE)
def test_decode_small_blocks_of_32(name, k):
    raw = _random_raw(name, 5, k, seed=k)
    np.testing.assert_array_equal(
        decode_gguf(raw, name, k).dequantize().numpy(), _reference(raw, name)
    )


def test_q4_0_nibbles_are_repaired_into_even_odd_bytes():
    # one block, d = 1: element i < 16 is byte i's low nibble (= i), element 16 + i its
    # high nibble (= 15 - i)
    qs = np.arange(16, dtype=np.uint8) | ((15 - np.arange(16, dtype=np.uint8)) << 4)
    raw = np.concatenate([np.array([1.0], np.float16).view(np.uint8), qs])[None]
    qw = decode_gguf(raw, "Q4_0", 32)
    expected = list(range(16)) + list(range(15, -1, -1))
    assert qw.unpacked_codes()[0].tolist() == expected
    assert qw.codes[0, 0].item() == 0x10 and qw.codes[0, 8].item() == 0xEF  # (0, 1), (15, 14)
    assert qw.dequantize()[0].tolist() == [float(c - 8) for c in expected]


def test_q4_0_mins_fall_back_to_float32_where_8d_overflows_float16():
    raw = _random_raw("Q4_0", 4, 64, seed=1, quantized=False)
    raw.reshape(4, 2, 18)[1, 1, :2] = np.array([9000.0], np.float16).view(np.uint8)
    qw = decode_gguf(raw, "Q4_0", 64)
    assert qw.scales.dtype == qw.mins.dtype == torch.float32
    assert qw.mins[1, 1].item() == -72000.0
    np.testing.assert_array_equal(qw.dequantize().numpy(), _reference(raw, "Q4_0"))
    assert decode_gguf(raw[[0, 2, 3]], "Q4_0", 64).mins.dtype == torch.float16


def test_decode_of_a_gguf_file_read_back_with_ggufreader(tmp_path):
    rng = np.random.default_rng(3)
    floats = rng.standard_normal((6, 256), dtype=np.float32)
    quantized = {
        "q8": ("Q8_0", gguf.quants.quantize(floats, _qtype("Q8_0"))),
        "q4k": ("Q4_K", _random_raw("Q4_K", 6, 256, seed=4)),
        "q6k": ("Q6_K", _random_raw("Q6_K", 6, 256, seed=5)),
    }
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for name, (type_name, raw) in quantized.items():
        writer.add_tensor(name, raw, raw_dtype=_qtype(type_name))
    writer.add_tensor("norm", floats[0])
    writer.add_tensor("half", floats[:2].astype(np.float16))
    bf16 = gguf.quants.quantize(floats[:3], _qtype("BF16"))
    writer.add_tensor("bf16", bf16, raw_dtype=_qtype("BF16"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's warning about non-writable arrays
        for name in quantized:
            t = tensors[name]
            qw = decode_gguf(t.data, t.tensor_type.name, int(t.shape[0]))
            np.testing.assert_array_equal(
                qw.dequantize().numpy(), _reference(t.data, t.tensor_type.name)
            )
        for name, shape in [("norm", (256,)), ("half", (2, 256)), ("bf16", (3, 256))]:
            t = tensors[name]
            out = gguf_float(t.data, t.tensor_type.name, shape)
            ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            assert out.dtype == torch.float32 and out.shape == shape
            np.testing.assert_array_equal(out.numpy(), ref)
            out += 1  # a fresh, writable tensor


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "IQ3_S", "Q8_1", "F16", "TQ1_0"])
def test_unsupported_types_raise_naming_the_type(type_name):
    with pytest.raises(UnsupportedQuantization, match=type_name):
        decode_gguf(np.zeros((1, 144), np.uint8), type_name, 256)
    assert issubclass(UnsupportedQuantization, ValueError)


def test_gguf_float_rejects_quantized_types():
    with pytest.raises(UnsupportedQuantization, match="Q8_0"):
        gguf_float(np.zeros(34, np.uint8), "Q8_0", (32,))


def test_bad_raw_data_raises():
    raw = _random_raw("Q4_K", 2, 512, seed=0)
    with pytest.raises(ValueError, match="288 bytes"):
        decode_gguf(raw[:, :-144], "Q4_K", 512)
    with pytest.raises(ValueError, match="blocks of 256"):
        decode_gguf(raw, "Q4_K", 500)
    with pytest.raises(ValueError, match="uint8"):
        decode_gguf(raw.view(np.int8), "Q4_K", 512)
    with pytest.raises(ValueError, match="uint8"):
        decode_gguf(raw.reshape(-1), "Q4_K", 512)
    with pytest.raises(ValueError, match="needs 16 bytes"):
        gguf_float(np.zeros(3, np.float32), "F32", (4,))


# --- QuantizedWeight ----------------------------------------------------------------------


def _parts(n=4, k=64, groups=2, bits=8, scale_dtype=torch.float32, mins=False):
    codes = (
        torch.zeros(n, k, dtype=torch.int8)
        if bits == 8
        else torch.zeros(n, k // 2, dtype=torch.uint8)
    )
    scales = torch.ones(n, groups, dtype=scale_dtype)
    return dict(
        codes=codes,
        scales=scales,
        mins=torch.zeros_like(scales) if mins else None,
        group_size=k // groups,
        bits=bits,
        source="int8",
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(bits=5), "bits must be 4 or 8"),
        (dict(codes=torch.zeros(4, 64, dtype=torch.uint8)), "8-bit codes must be torch.int8"),
        (dict(bits=4), "4-bit codes must be torch.uint8"),
        (dict(codes=torch.zeros(4, 64, 1, dtype=torch.int8)), "2-D"),
        (dict(group_size=24), "group_size 24 must be a positive divisor of K = 64"),
        (dict(group_size=0), "group_size 0"),
        (dict(scales=torch.ones(4, 2, dtype=torch.bfloat16)), "float16 or float32"),
        (dict(scales=torch.ones(4, 3)), r"scales must be .* shape \(4, 2\)"),
        (dict(mins=torch.zeros(4, 2, dtype=torch.float16)), "mins must have the scales' dtype"),
        (dict(mins=torch.zeros(4, 1)), r"mins must be .* shape \(4, 2\)"),
        (dict(source=""), "source"),
        (dict(codes=torch.zeros(4, 0, dtype=torch.int8)), "K = 0"),
    ],
)
def test_invalid_weights_raise(change, message):
    QuantizedWeight(**_parts())  # the unchanged parts are valid
    with pytest.raises(ValueError, match=message):
        QuantizedWeight(**{**_parts(), **change})


def test_shape_and_nbytes():
    qw = QuantizedWeight(
        **_parts(n=4, k=64, groups=2, bits=4, scale_dtype=torch.float16, mins=True)
    )
    assert qw.shape == (4, 64)
    assert qw.nbytes == 4 * 32 + 2 * (4 * 2 * 2)
    q6 = _weight("Q6_K", 3, 256)
    assert q6.nbytes == 3 * 256 + 3 * 16 * 4


def _deq_all(names=GGUF_BLOCK_TYPES, n=6, k=512):
    return [(name, _weight(name, n, k, seed=i)) for i, name in enumerate(names)]


@pytest.mark.parametrize("name", GGUF_BLOCK_TYPES)
def test_narrow_rows_agrees_with_the_dequantized_weight(name):
    qw = _weight(name, 9, 512)
    for start, size in [(0, 9), (2, 3), (8, 1), (4, 0)]:
        part = qw.narrow_rows(start, size)
        assert part.shape == (size, 512) and part.source == name
        assert _bits_equal(part.dequantize(), qw.dequantize()[start : start + size])


@pytest.mark.parametrize("start, size", [(-1, 2), (8, 2), (0, 10), (3, -1)])
def test_narrow_rows_out_of_range_raises(start, size):
    with pytest.raises(ValueError, match=f"start {start}, size {size}"):
        _weight("Q4_K", 9, 256).narrow_rows(start, size)


@pytest.mark.parametrize("name", GGUF_BLOCK_TYPES)
def test_narrow_cols_of_whole_groups_agrees_with_the_dequantized_weight(name):
    qw = _weight(name, 5, 768)
    for start, size in [(0, 768), (256, 256), (32, 64), (736, 32), (16, 48)]:
        if start % qw.group_size or size % qw.group_size:
            continue  # (16, 48): Q6_K's groups of 16 only
        part = qw.narrow_cols(start, size)
        assert part.shape == (5, size) and part.group_size == qw.group_size
        assert part.codes.is_contiguous() and part.scales.is_contiguous()
        assert _bits_equal(part.dequantize(), qw.dequantize()[:, start : start + size])


def test_narrow_cols_not_on_group_boundaries_raises_naming_the_numbers():
    qw = _weight("Q4_K", 2, 512)
    with pytest.raises(ValueError, match=r"start 16 and size 64 .* group size 32"):
        qw.narrow_cols(16, 64)
    with pytest.raises(ValueError, match="start 32 and size 48"):
        qw.narrow_cols(32, 48)
    with pytest.raises(ValueError, match=r"\[480, 544\)"):
        qw.narrow_cols(480, 64)
    with pytest.raises(ValueError, match="empty"):
        qw.narrow_cols(32, 0)


def test_narrow_cols_per_channel_allows_any_range():
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    q8 = quantize_int8(w)
    for start, size in [(3, 5), (0, 1), (39, 1), (0, 40)]:
        part = q8.narrow_cols(start, size)
        assert part.group_size == size and part.scales is q8.scales
        assert _bits_equal(part.dequantize(), q8.dequantize()[:, start : start + size])
    # a 4-bit weight with one scale per channel: even ranges only (whole bytes)
    codes = torch.randint(0, 256, (6, 20), dtype=torch.uint8, generator=torch.Generator())
    q4 = QuantizedWeight(codes, q8.scales, q8.scales / 3, 40, 4, "int4")
    part = q4.narrow_cols(2, 6)
    assert part.group_size == 6
    assert _bits_equal(part.dequantize(), q4.dequantize()[:, 2:8])
    with pytest.raises(ValueError, match="start 3 and size 6 must be even"):
        q4.narrow_cols(3, 6)
    with pytest.raises(ValueError, match="start 2 and size 5 must be even"):
        q4.narrow_cols(2, 5)


def _check_cat(parts):
    joined = cat_rows(parts)
    expected = torch.cat([p.dequantize() for p in parts])
    assert joined.shape == expected.shape
    assert _bits_equal(joined.dequantize(), expected)
    return joined


def test_cat_rows_of_q4_k_and_q6_k_promotes_exactly():
    q4k, q6k = _weight("Q4_K", 5, 512, seed=1), _weight("Q6_K", 3, 512, seed=2)
    joined = _check_cat([q4k, q6k, q4k.narrow_rows(1, 2)])
    assert (joined.bits, joined.group_size, joined.scales.dtype) == (8, 16, torch.float32)
    assert joined.mins is not None and joined.source == "Q4_K+Q6_K"
    # Q6_K's rows: -0.0 mins leave even -0.0 products (negative scale, code 0) as they were
    assert (torch.signbit(joined.dequantize()[5:8]) == torch.signbit(q6k.dequantize())).all()


def test_cat_rows_of_every_format_and_the_online_ones():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 512, generator=gen)
    parts = [qw for _, qw in _deq_all(k=512)] + [quantize_int8(w), quantize_int4(w, 128)]
    joined = _check_cat(parts)
    assert (joined.bits, joined.group_size) == (8, 16)
    assert joined.source == "+".join((*GGUF_BLOCK_TYPES, "int8", "int4"))


def test_cat_rows_of_one_form_keeps_it():
    a, b = _weight("Q4_1", 3, 256, seed=1), _weight("Q4_1", 2, 256, seed=2)
    joined = _check_cat([a, b])
    assert (joined.bits, joined.group_size, joined.scales.dtype) == (4, 32, torch.float16)
    assert joined.source == "Q4_1" and joined.codes.shape == (5, 128)


def test_cat_rows_of_4_bit_and_8_bit_and_per_channel_parts():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 96, generator=gen)
    int8, int4 = quantize_int8(w), quantize_int4(w, 32)  # groups of 96 and of 32
    q4_0 = _weight("Q4_0", 2, 96)  # float16 scales and mins
    q8_0 = _weight("Q8_0", 2, 96)  # float16 scales, no mins
    joined = _check_cat([int4, q4_0])
    assert joined.bits == 4 and joined.scales.dtype == torch.float32
    joined = _check_cat([int8, q4_0, q8_0, int4])
    assert (joined.bits, joined.group_size, joined.mins is None) == (8, 32, False)
    assert _check_cat([int8, int8]).group_size == 96
    assert _check_cat([q8_0, q8_0]).scales.dtype == torch.float16
    joined = _check_cat(
        [_weight("Q6_K", 2, 256), quantize_int8(torch.randn(2, 256, generator=gen))]
    )
    assert (joined.group_size, joined.mins) == (16, None)


def test_cat_rows_source_counts_joined_names_once():
    q4k, q6k = _weight("Q4_K", 2, 256), _weight("Q6_K", 2, 256)
    assert cat_rows([cat_rows([q4k, q6k]), q4k, _weight("Q8_0", 1, 256)]).source == "Q4_K+Q6_K+Q8_0"


def test_cat_rows_errors():
    with pytest.raises(ValueError, match="at least one"):
        cat_rows([])
    with pytest.raises(ValueError, match=r"share K .*\[256, 512\]"):
        cat_rows([_weight("Q4_K", 2, 256), _weight("Q4_K", 2, 512)])


def test_promoted_only_widens():
    q8 = _weight("Q8_0", 2, 256)
    q4k = _weight("Q4_K", 2, 256)
    assert q8.promoted(8, 32, torch.float16, False) is q8
    with pytest.raises(ValueError, match="8-bit codes to 4 bits"):
        q8.promoted(4, 32, torch.float16, False)
    with pytest.raises(ValueError, match="group size 64 must divide the current group size 32"):
        q8.promoted(8, 64, torch.float16, False)
    with pytest.raises(ValueError, match=r"float32 scales to torch\.float16"):
        q4k.promoted(4, 32, torch.float16, True)
    with pytest.raises(ValueError, match="drop the mins"):
        q4k.promoted(4, 32, torch.float32, False)
    wide = q4k.promoted(8, 8, torch.float32, True)
    assert (wide.bits, wide.group_size, wide.codes.dtype) == (8, 8, torch.int8)
    assert _bits_equal(wide.dequantize(), q4k.dequantize())
    wide = q8.promoted(8, 4, torch.float32, True)
    assert _bits_equal(wide.dequantize(), q8.dequantize())


# --- online quantizers --------------------------------------------------------------------


def _weight_with_special_rows(n=12, k=256, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[1] = 0  # a row (and groups) of zeros
    w[2, :128] = 0.3  # constant positive groups
    w[3, :128] = -0.7  # constant negative groups
    w[4] = w[4].abs() + 1.0  # groups entirely above zero
    w[5] = -w[5].abs() - 2.0  # entirely below
    w[6, 5] = 40.0  # an outlier
    return w


def test_quantize_int8_error_bound_and_form():
    w = _weight_with_special_rows()
    qw = quantize_int8(w)
    assert (qw.bits, qw.group_size, qw.source, qw.mins) == (8, 256, "int8", None)
    assert qw.scales.shape == (12, 1) and qw.scales.dtype == torch.float32
    assert (qw.scales > 0).all() and qw.codes.abs().max() <= 127
    assert (qw.codes[1] == 0).all()
    assert (qw.codes.abs().amax(dim=1)[qw.scales[:, 0] != 1] == 127).all()
    err = (w - qw.dequantize()).abs()
    assert (err <= qw.scales / 2 + 1e-6 * w.abs().amax(dim=1, keepdim=True)).all()


def test_quantize_int8_of_bfloat16_and_in_chunks(monkeypatch):
    w = _weight_with_special_rows().to(torch.bfloat16)
    whole = quantize_int8(w)
    monkeypatch.setattr(online, "CHUNK_BYTES", 3 * 256 * 4)  # 3 rows a chunk
    chunked = quantize_int8(w)
    assert torch.equal(whole.codes, chunked.codes) and torch.equal(whole.scales, chunked.scales)
    assert torch.equal(w, _weight_with_special_rows().to(torch.bfloat16))  # input untouched


@pytest.mark.parametrize("group_size", [32, 128])
def test_quantize_int4_error_bound_and_form(group_size):
    w = _weight_with_special_rows()
    original = w.clone()
    qw = quantize_int4(w, group_size)
    assert torch.equal(w, original)
    assert (qw.bits, qw.group_size, qw.source) == (4, group_size, "int4")
    assert qw.codes.shape == (12, 128) and qw.scales.shape == (12, 256 // group_size)
    assert qw.scales.dtype == qw.mins.dtype == torch.float32 and (qw.scales > 0).all()
    zero = (-qw.mins / qw.scales).round()  # mins = -scale * zero, zero a whole 0..15
    assert torch.equal(qw.mins, -qw.scales * zero) and (zero >= 0).all() and (zero <= 15).all()
    deq = qw.dequantize()
    scale = qw.scales.repeat_interleave(group_size, dim=1)
    err = (w - deq).abs()
    assert (err <= scale / 2 + 1e-6 * w.abs().amax(dim=1, keepdim=True)).all()
    assert torch.equal(deq[1], torch.zeros(256))  # zeros reproduced
    assert torch.equal(deq[2, :128], w[2, :128]) and torch.equal(deq[3, :128], w[3, :128])


def test_quantize_int4_in_chunks_matches(monkeypatch):
    w = _weight_with_special_rows(n=10)
    whole = quantize_int4(w, 32)
    monkeypatch.setattr(online, "CHUNK_BYTES", 4 * 256 * 4)
    chunked = quantize_int4(w, 32)
    for name in ("codes", "scales", "mins"):
        assert torch.equal(getattr(whole, name), getattr(chunked, name))


@pytest.mark.parametrize("group_size, k", [(64, 256), (32, 48), (128, 192), (0, 256)])
def test_quantize_int4_group_validation(group_size, k):
    with pytest.raises(ValueError, match=f"group_size {group_size} .* K = {k}"):
        quantize_int4(torch.randn(2, k), group_size)


@pytest.mark.parametrize("quantize", [quantize_int8, lambda w: quantize_int4(w, 32)])
def test_online_quantizers_reject_bad_weights(quantize):
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([[1.0, float("nan")] * 16]))
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(32))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("n, k", [(1, 256), (37, 768), (130, 512)])
def test_the_cpp_decoder_equals_the_numpy_one_bit_for_bit(name, n, k):
    """pagestream_kernels/cpu/gguf_decode.cpp (what decode_gguf runs where the extension builds) and
    the numpy decoders (the reference): the same codes, scales and mins."""
    from pagestream_kernels import cpu
    from services.worker.layers.quantization import gguf_blocks

    reason = cpu.unavailable_reason()
    assert reason is None, reason  # the CPU extension builds on every supported machine
    raw = _random_raw(name, n, k, seed=k + n)
    native = gguf_blocks._native_decoder(name)(raw)
    block, size = gguf_blocks._BLOCKS[name]
    reference = gguf_blocks._DECODERS[name](raw.reshape(n, k // block, size), n)
    assert (native.bits, native.group_size) == (reference.bits, reference.group_size)
    assert torch.equal(native.codes, reference.codes)
    assert torch.equal(native.scales.view(torch.int32), reference.scales.view(torch.int32))
    if reference.mins is None:
        assert native.mins is None
    else:
        assert torch.equal(native.mins.view(torch.int32), reference.mins.view(torch.int32))
