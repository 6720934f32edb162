"""GGUF's block-quantized tensors decoded, exactly, into `QuantizedWeight`.

`decode_gguf(raw, type_name, k)` takes a 2-D tensor's bytes (uint8 [N, bytes per row], as
the file's map holds them) and its type's name. Every decoded value equals ggml's: the fp16
fields and the products d * sc are exact in float32. Q4_K and Q6_K decode in C++ where the
extension builds (pagestream_kernels/cpu/gguf_decode.cpp, bit for bit the same); the numpy
decoders are the reference and the fallback. `gguf_float` reads F32 / F16 / BF16 as float32.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from services.worker.layers.quantization.quantized_weight import QuantizedWeight


class UnsupportedQuantization(ValueError):
    """A tensor type this package cannot represent as a QuantizedWeight."""


# The block layouts (ggml's, little-endian) and what each becomes as a QuantizedWeight:
#
#   Q8_0  32 elements, 34 bytes: fp16 d, 32 int8 q; w = d * q
#         -> 8 bits, groups of 32, float16 scales d
#   Q4_0  32 elements, 18 bytes: fp16 d, 16 bytes of nibbles (element i < 16 in byte i's
#         low nibble, element 16 + i in its high nibble); w = d * (q - 8)
#         -> 4 bits, groups of 32, float16 scales d and mins -8 d (float32 both where
#         some 8 d overflows float16)
#   Q4_1  32 elements, 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles as Q4_0; w = d * q + m
#         -> 4 bits, groups of 32, float16 scales d and mins m
#   Q5_0  32 elements, 22 bytes: fp16 d, 4 bytes qh (bit i: bit 4 of element i), 16 bytes
#         of low nibbles as Q4_0; w = d * (q - 16)
#         -> 8 bits (codes -16..15), groups of 32, float16 scales d
#   Q5_1  32 elements, 24 bytes: fp16 d, fp16 m, qh and nibbles as Q5_0; w = d * q + m
#         -> 8 bits (codes 0..31), groups of 32, float16 scales d and mins m
#   IQ4_NL 32 elements, 18 bytes: fp16 d, nibbles as Q4_0 indexing a fixed table of 16
#         int8 values v; w = d * v[q]
#         -> 8 bits (the table's values), groups of 32, float16 scales d
#   Q2_K  256 elements, 84 bytes: 16 bytes of 4-bit scales (low nibble) and mins (high),
#         64 bytes qs (element e = 128 h + 32 s + l: bits 2 s of qs[32 h + l]), fp16 d,
#         fp16 dmin; w = d sc_j * q - dmin m_j, sub-blocks of 16
#         -> 4 bits (codes 0..3), groups of 16, float32 scales d sc_j and mins -dmin m_j
#   Q3_K  256 elements, 110 bytes: 32 bytes hmask (bit e // 32 of byte e % 32: the high
#         bit, set meaning no -4), 64 bytes qs as Q2_K, 12 bytes of sixteen 6-bit scales,
#         fp16 d; w = d (sc_j - 32) * (q - 4 (1 - h)), sub-blocks of 16
#         -> 8 bits (codes -4..3), groups of 16, float32 scales d (sc_j - 32)
#   IQ4_XS 256 elements, 136 bytes: fp16 d, 2 bytes of the scales' high bits, 4 bytes of
#         their low nibbles, 128 bytes of IQ4_NL nibbles (16 a sub-block of 32);
#         w = d (sc_j - 32) * v[q]
#         -> 8 bits (the table's values), groups of 32, float32 scales d (sc_j - 32)
#   Q4_K  256 elements, 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc_j
#         and mins m_j, 128 bytes of nibbles (32-byte chunk c: sub-block 2c in the low
#         nibbles, 2c + 1 in the high ones); w = d sc_j * q - dmin m_j
#         -> 4 bits, groups of 32, float32 scales d sc_j and mins -dmin m_j
#   Q5_K  256 elements, 176 bytes: d, dmin, 12 bytes of scales as Q4_K, 32 bytes qh (bit j
#         of qh[l] is bit 4 of sub-block j's element l), 128 bytes of low nibbles as Q4_K
#         -> 8 bits (codes 0..31), groups of 32, float32 scales and mins as Q4_K
#   Q6_K  256 elements, 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; per
#         half h of 128 elements, element r has low bits ql[64 h + r % 64] >> 4 (r // 64),
#         high bits qh[32 h + r % 32] >> 2 (r // 32); w = d sc_(e // 16) * (q - 32)
#         -> 8 bits (codes -32..31), groups of 16, float32 scales d sc
#
# The promoted forms (d q + (-8 d) for d (q - 8); x + (-m) for x - m) round as ggml's do,
# or not at all.
#
# type name -> (elements per block, bytes per block)
_BLOCKS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "IQ4_NL": (32, 18),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_XS": (256, 136),
}
# IQ4_NL / IQ4_XS's non-linear code book (ggml's kvalues_iq4nl)
_IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
GGUF_BLOCK_TYPES = tuple(_BLOCKS)
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def _bytes(blocks: np.ndarray, start: int, stop: int, dtype: type = np.uint8) -> np.ndarray:
    """Bytes start..stop of every block [N, nb, B] as a fresh array [N, nb, (stop-start)/size]."""
    return np.ascontiguousarray(blocks[..., start:stop]).view(dtype)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte start of every block -> float32 [N, nb] (exact)."""
    return _bytes(blocks, start, start + 2, np.float16)[..., 0].astype(np.float32)


def _rows(array: np.ndarray, n: int) -> torch.Tensor:
    """[N, nb, ...] -> a torch tensor [N, nb * ...] (sharing the fresh numpy array)."""
    return torch.from_numpy(np.ascontiguousarray(array).reshape(n, -1))


def _repair_nibbles(qs: np.ndarray) -> np.ndarray:
    """Chunks [..., L] of ggml nibbles (element i in byte i's low nibble, element L + i in
    its high nibble) -> [..., L] in QuantizedWeight's layout (elements 2j, 2j + 1 in byte j's
    low, high nibble)."""
    even, odd = qs[..., 0::2], qs[..., 1::2]  # [..., L/2]
    low_half = (even & 0x0F) | ((odd & 0x0F) << 4)  # elements 0..L-1
    high_half = (even >> 4) | (odd & 0xF0)  # elements L..2L-1
    return np.concatenate([low_half, high_half], axis=-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Chunks [..., L] of ggml nibbles -> codes [..., 2L] in element order (0..15)."""
    size = qs.shape[-1]
    out = np.empty((*qs.shape[:-1], 2 * size), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[..., :size])
    np.right_shift(qs, 4, out=out[..., size:])
    return out


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> the eight 6-bit scales and mins, each [..., 8].

    Bytes 0..3: scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7; bytes 4..7:
    mins 0..3 and the top 2 bits of mins 4..7; bytes 8..11: the low 4 bits of scales 4..7
    (low nibble) and of mins 4..7 (high nibble).
    """
    sc_lo, mn_lo, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales_hi = (rest & 0x0F) | ((sc_lo >> 6) << 4)
    mins_hi = (rest >> 4) | ((mn_lo >> 6) << 4)
    scales = np.concatenate([sc_lo & 0x3F, scales_hi], axis=-1)
    mins = np.concatenate([mn_lo & 0x3F, mins_hi], axis=-1)
    return scales, mins


def _k_scale_tensors(blocks: np.ndarray, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: float32 scales d sc_j and mins -dmin m_j, each [N, K // 32] (exact)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)  # [N, nb]
    sc, mn = _k_scales_mins(blocks[..., 4:16])  # [N, nb, 8]
    scales = d[..., None] * sc.astype(np.float32)
    mins = -(dmin[..., None] * mn.astype(np.float32))
    return _rows(scales, n), _rows(mins, n)


def _q8_0(blocks: np.ndarray, n: int) -> QuantizedWeight:
    scales = torch.from_numpy(_bytes(blocks, 0, 2, np.float16)[..., 0].copy())
    codes = _rows(_bytes(blocks, 2, 34, np.int8), n)
    return QuantizedWeight(codes, scales, None, 32, 8, "Q8_0")


def _q4_0(blocks: np.ndarray, n: int) -> QuantizedWeight:
    d = _f16(blocks, 0)  # [N, nb]
    with np.errstate(over="ignore"):
        mins16 = (d * -8).astype(np.float16)
    overflow = bool(np.any(np.isinf(mins16) & np.isfinite(d)))
    dtype = np.float32 if overflow else np.float16  # -8 d is exact wherever it is finite
    codes = _rows(_repair_nibbles(blocks[..., 2:18]), n)
    scales, mins = _rows(d.astype(dtype), n), _rows((d * -8).astype(dtype), n)
    return QuantizedWeight(codes, scales, mins, 32, 4, "Q4_0")


def _q4_1(blocks: np.ndarray, n: int) -> QuantizedWeight:
    scales = torch.from_numpy(_bytes(blocks, 0, 2, np.float16)[..., 0].copy())
    mins = torch.from_numpy(_bytes(blocks, 2, 4, np.float16)[..., 0].copy())
    codes = _rows(_repair_nibbles(blocks[..., 4:20]), n)
    return QuantizedWeight(codes, scales, mins, 32, 4, "Q4_1")


def _five_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes qh at byte `start` and the 16 bytes of nibbles after them ->
    codes 0..31 [N, nb, 32] in element order."""
    codes = _nibbles(blocks[..., start + 4 : start + 20])  # [N, nb, 32]
    qh = _bytes(blocks, start, start + 4)  # [N, nb, 4]: bit i of the 32 -> element i
    high = np.unpackbits(qh, axis=-1, bitorder="little")  # [N, nb, 32]
    codes |= high << 4
    return codes


def _q5_0(blocks: np.ndarray, n: int) -> QuantizedWeight:
    scales = torch.from_numpy(_bytes(blocks, 0, 2, np.float16)[..., 0].copy())
    codes = _five_bits(blocks, 2).view(np.int8)
    codes -= 16
    return QuantizedWeight(_rows(codes, n), scales, None, 32, 8, "Q5_0")


def _q5_1(blocks: np.ndarray, n: int) -> QuantizedWeight:
    scales = torch.from_numpy(_bytes(blocks, 0, 2, np.float16)[..., 0].copy())
    mins = torch.from_numpy(_bytes(blocks, 2, 4, np.float16)[..., 0].copy())
    codes = _five_bits(blocks, 4).view(np.int8)
    return QuantizedWeight(_rows(codes, n), scales, mins, 32, 8, "Q5_1")


def _iq4_nl(blocks: np.ndarray, n: int) -> QuantizedWeight:
    scales = torch.from_numpy(_bytes(blocks, 0, 2, np.float16)[..., 0].copy())
    codes = _IQ4_VALUES[_nibbles(blocks[..., 2:18])]  # [N, nb, 32]
    return QuantizedWeight(_rows(codes, n), scales, None, 32, 8, "IQ4_NL")


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 64 bytes qs [N, nb, 64] -> codes 0..3 [N, nb, 256]: element
    128 h + 32 s + l is bits 2 s of byte 32 h + l."""
    halves = qs.reshape(*qs.shape[:2], 2, 1, 32)  # [N, nb, h, 1, l]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    return ((halves >> shifts) & 3).reshape(*qs.shape[:2], 256)


def _q2_k(blocks: np.ndarray, n: int) -> QuantizedWeight:
    packed = blocks[..., 0:16]  # [N, nb, 16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)  # [N, nb]
    scales = d[..., None] * (packed & 0x0F).astype(np.float32)
    mins = -(dmin[..., None] * (packed >> 4).astype(np.float32))
    codes = _two_bit_planes(blocks[..., 16:80])  # [N, nb, 256]
    packed_codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedWeight(_rows(packed_codes, n), _rows(scales, n), _rows(mins, n), 16, 4, "Q2_K")


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes [..., 12] -> its sixteen 6-bit scales [..., 16] (0..63): bytes 0..7
    hold the low nibbles of scales j (low nibble) and 8 + j (high nibble); bits 2 i of
    byte 8 + j are the top bits of scale 4 i + j."""
    low = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    high = (packed[..., None, 8:12] >> shifts) & 3  # [..., i, j]: scale 4 i + j
    return low | (high.reshape(*packed.shape[:-1], 16) << 4)


def _q3_k(blocks: np.ndarray, n: int) -> QuantizedWeight:
    sc = _q3_k_scales(blocks[..., 96:108]).view(np.int8) - np.int8(32)  # [N, nb, 16]
    scales = _f16(blocks, 108)[..., None] * sc.astype(np.float32)
    codes = _two_bit_planes(blocks[..., 32:96]).view(np.int8)  # [N, nb, 256]
    hmask = np.unpackbits(blocks[..., 0:32, None], axis=-1, bitorder="little")  # [.., l, b]
    high = np.swapaxes(hmask, -1, -2).reshape(*blocks.shape[:2], 256)  # e = 32 b + l
    codes -= ((1 - high) << 2).view(np.int8)
    return QuantizedWeight(_rows(codes, n), _rows(scales, n), None, 16, 8, "Q3_K")


def _iq4_xs(blocks: np.ndarray, n: int) -> QuantizedWeight:
    d = _f16(blocks, 0)  # [N, nb]
    high_bits = _bytes(blocks, 2, 4, np.uint16)  # [N, nb, 1]: bits 2 j, 2 j + 1 -> j
    low = blocks[..., 4:8]  # [N, nb, 4]: scale 2 i in the low nibble of byte i, 2 i + 1 high
    low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(*blocks.shape[:2], 8)
    high = (high_bits >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [N, nb, 8]
    sc = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    scales = d[..., None] * sc.astype(np.float32)
    qs = blocks[..., 8:136].reshape(*blocks.shape[:2], 8, 16)
    codes = _IQ4_VALUES[_nibbles(qs)]  # [N, nb, 8, 32]
    return QuantizedWeight(_rows(codes, n), _rows(scales, n), None, 32, 8, "IQ4_XS")


def _q4_k(blocks: np.ndarray, n: int) -> QuantizedWeight:
    scales, mins = _k_scale_tensors(blocks, n)
    qs = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 32)  # [N, nb, chunk, 32]
    codes = _rows(_repair_nibbles(qs), n)
    return QuantizedWeight(codes, scales, mins, 32, 4, "Q4_K")


def _q5_k(blocks: np.ndarray, n: int) -> QuantizedWeight:
    scales, mins = _k_scale_tensors(blocks, n)
    qh = _bytes(blocks, 16, 48)  # [N, nb, 32]: bit j of byte l -> sub-block j, element l
    qs = blocks[..., 48:176].reshape(*blocks.shape[:2], 4, 32)
    codes = _nibbles(qs).reshape(*blocks.shape[:2], 8, 32)  # [N, nb, sub-block, 32]
    for j in range(8):  # in place: a fresh [N, K] array per step costs more than the math
        codes[..., j, :] |= ((qh >> j) & 1) << 4
    return QuantizedWeight(_rows(codes.view(np.int8), n), scales, mins, 32, 8, "Q5_K")


def _q6_k(blocks: np.ndarray, n: int) -> QuantizedWeight:
    halves = (*blocks.shape[:2], 2)
    ql = blocks[..., 0:128].reshape(*halves, 64)  # [N, nb, half, 64]
    qh = _bytes(blocks, 128, 192).reshape(*halves, 32)  # [N, nb, half, 32]
    codes = _nibbles(ql).reshape(*halves, 4, 32)  # r < 64: low nibbles, r >= 64: high
    for pair in range(4):  # bits 2 pair, 2 pair + 1 of qh[l] -> element 32 pair + l
        codes[..., pair, :] |= ((qh >> (2 * pair)) & 3) << 4
    codes = codes.view(np.int8)
    codes -= 32  # 0..63 -> -32..31, in place
    sc = _bytes(blocks, 192, 208, np.int8).astype(np.float32)  # [N, nb, 16]
    scales = _f16(blocks, 208)[..., None] * sc
    return QuantizedWeight(_rows(codes, n), _rows(scales, n), None, 16, 8, "Q6_K")


_DECODERS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "IQ4_NL": _iq4_nl,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_XS": _iq4_xs,
}


def _unsupported(type_name: str, supported: tuple[str, ...]) -> UnsupportedQuantization:
    return UnsupportedQuantization(
        f"GGUF tensor type {type_name} is not supported here (supported: {', '.join(supported)})"
    )


def decode_gguf(raw: np.ndarray, type_name: str, k: int) -> QuantizedWeight:
    """A quantized GGUF tensor's bytes uint8 [N, bytes_per_row] -> QuantizedWeight [N, k].

    type_name is the tensor type's name ("Q4_K", ...), k the input features (the row's
    element count). The result owns fresh CPU tensors (raw may be a read-only memmap).
    """
    check_gguf_rows(raw, type_name, k)
    native = _native_decoder(type_name)
    if native is not None:
        return native(raw)
    block, size = _BLOCKS[type_name]
    blocks = raw.reshape(raw.shape[0], k // block, size)  # [N, nb, bytes per block]
    return _DECODERS[type_name](blocks, raw.shape[0])


def check_gguf_rows(raw: np.ndarray, type_name: str, k: int) -> None:
    """What `decode_gguf` would refuse, checked without decoding: an unsupported type
    (UnsupportedQuantization), or bytes that are not rows of whole blocks of K elements."""
    if type_name not in _DECODERS:
        raise _unsupported(type_name, GGUF_BLOCK_TYPES)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2:
        raise ValueError(
            f"raw {type_name} data must be a uint8 numpy array [N, bytes_per_row], got "
            f"{type(raw).__name__} {getattr(raw, 'dtype', '')} {getattr(raw, 'shape', '')}"
        )
    block, size = _BLOCKS[type_name]
    if k <= 0 or k % block:
        raise ValueError(f"{type_name} rows hold blocks of {block} elements; K = {k} is not")
    if raw.shape[1] != k // block * size:
        raise ValueError(
            f"a {type_name} row of K = {k} is {k // block * size} bytes "
            f"({k // block} blocks of {size}), got {raw.shape[1]}"
        )


def gguf_block(type_name: str) -> tuple[int, int]:
    """(elements, bytes) of one block of a supported quantized type."""
    return _BLOCKS[type_name]


def _native_q4_k(module, raw: np.ndarray) -> QuantizedWeight:
    codes, scales, mins = module.decode_q4_k(_as_tensor(raw))
    return QuantizedWeight(codes, scales, mins, 32, 4, "Q4_K")


def _native_q6_k(module, raw: np.ndarray) -> QuantizedWeight:
    codes, scales = module.decode_q6_k(_as_tensor(raw))
    return QuantizedWeight(codes, scales, None, 16, 8, "Q6_K")


_NATIVE_DECODERS = {"Q4_K": _native_q4_k, "Q6_K": _native_q6_k}


def _native_decoder(type_name: str):
    """raw -> QuantizedWeight through the C++ decoder of a K-quant type
    (pagestream_kernels/cpu/gguf_decode.cpp: the same values, row blocks over the thread team, ~5x
    faster than numpy), or None (the extension does not build here, or a type decoded in
    numpy only)."""
    decoder = _NATIVE_DECODERS.get(type_name)
    if decoder is None:
        return None
    from pagestream_kernels import cpu

    if cpu.unavailable_reason() is not None:
        return None
    return functools.partial(decoder, cpu.load())


def _as_tensor(raw: np.ndarray) -> torch.Tensor:
    """A uint8 array (maybe a read-only view of a file's map) as a tensor sharing it; the
    decoders only read it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def gguf_float(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An F32 / F16 / BF16 GGUF tensor -> float32 tensor of `shape` (torch order, outermost
    dimension first: ggml's ne reversed, as GGUFReader's arrays are), exactly.

    raw is GGUFReader's data for it, whatever its dtype (float32, float16, or BF16's uint8
    bytes); only its bytes are read.
    """
    if type_name not in GGUF_FLOAT_TYPES:
        raise _unsupported(type_name, GGUF_FLOAT_TYPES)
    shape = tuple(int(dim) for dim in shape)
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    item = 4 if type_name == "F32" else 2
    count = int(np.prod(shape, dtype=np.int64))
    if data.size != count * item:
        raise ValueError(
            f"{type_name} tensor of shape {shape} needs {count * item} bytes, got {data.size}"
        )
    if type_name == "F32":
        return torch.from_numpy(data.view(np.float32).reshape(shape).copy())
    if type_name == "F16":
        return torch.from_numpy(data.view(np.float16).reshape(shape).astype(np.float32))
    bits = torch.from_numpy(data.view(np.int16).reshape(shape).copy())
    return bits.view(torch.bfloat16).to(torch.float32)
