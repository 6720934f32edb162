"""fp8 KV-cache formats (vLLM's ``fp8`` = ``fp8_e4m3``, ``fp8_e5m2``) and the write-side
rounding the Triton kernels share.

A value is stored as ``x * (1 / scale)`` (float32) rounded to nearest-even and saturated to
the format's largest finite value (never inf or NaN); it reads back as ``stored * scale``.
The rounding is done in float32 bit arithmetic, so the final cast to fp8 is exact: the same
bits on a GPU (whose cvt rounds the same way) and in Triton's interpreter (whose fp8 cast
drops mantissa carries and rounds ties up, so it cannot be given an inexact value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8Format:
    """One OCP fp8 format: largest finite value, mantissa bits, smallest normal exponent."""

    max_value: float
    mantissa_bits: int
    min_normal_exp: int


FP8_FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(448.0, 3, -6),  # no inf; 0x7F is NaN, so 480 is not
    torch.float8_e5m2: Fp8Format(57344.0, 2, -14),  # IEEE-like: 61440 would round to inf
}


def fp8_format(dtype: torch.dtype) -> Fp8Format | None:
    """The format of an fp8 cache dtype, None for a float cache (bf16 / fp16 / fp32)."""
    return FP8_FORMATS.get(dtype)


def fp8_constexprs(dtype: torch.dtype) -> dict[str, object]:
    """The write kernel's fp8 constexprs for a cache of `dtype` (zeros for a float cache)."""
    fmt = fp8_format(dtype)
    if fmt is None:
        return {"FP8": False, "FP8_MAX": 0.0, "FP8_MANTISSA": 0, "FP8_MIN_EXP": 0}
    return {
        "FP8": True,
        "FP8_MAX": fmt.max_value,
        "FP8_MANTISSA": fmt.mantissa_bits,
        "FP8_MIN_EXP": fmt.min_normal_exp,
    }


def inverse_scale(scale: float) -> float:
    """The float32 reciprocal the write kernel multiplies by; ValueError for a bad scale."""
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"an fp8 KV scale must be a finite number > 0, got {scale!r}.")
    inverse = float(torch.tensor(1.0 / scale, dtype=torch.float32))
    if not (math.isfinite(inverse) and inverse > 0.0):
        raise ValueError(f"the fp8 KV scale {scale!r} has no float32 reciprocal.")
    return inverse


def quantize_reference(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the kernels store: ``x * (1 / scale)`` in float32, saturated, cast by torch
    (nearest-even)."""
    fmt = FP8_FORMATS[dtype]
    scaled = x.float() * torch.tensor(inverse_scale(scale), dtype=torch.float32)
    return scaled.clamp(-fmt.max_value, fmt.max_value).to(dtype)


@triton.jit
def round_to_fp8_grid(x, MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 ``x`` -> the nearest (ties to even) fp8 value, as float32, saturated to +-MAX.

    Normal range: round the float32 bits to MANTISSA mantissa bits (the carry runs into the
    exponent). Below 2**MIN_EXP the fp8 grid is uniform, 2**(MIN_EXP - MANTISSA): scale by an
    exact power of two and round to an integer with the 2**23 trick (one float32 rounding).
    NaN stays NaN.
    """
    clamped = tl.minimum(tl.maximum(x, -MAX), MAX)
    bits = clamped.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    magnitude = bits & 0x7FFFFFFF
    DROP: tl.constexpr = 23 - MANTISSA
    lsb = (magnitude >> DROP) & 1
    rounded = (magnitude + ((1 << (DROP - 1)) - 1) + lsb) & ~((1 << DROP) - 1)
    normal = rounded.to(tl.float32, bitcast=True)
    STEPS: tl.constexpr = 2.0 ** (MANTISSA - MIN_EXP)  # subnormal steps per unit
    steps = magnitude.to(tl.float32, bitcast=True) * STEPS  # exact: a power of two
    subnormal = ((steps + 8388608.0) - 8388608.0) * (1.0 / STEPS)  # 8388608 = 2**23
    MIN_NORMAL_BITS: tl.constexpr = (127 + MIN_EXP) << 23  # 2**MIN_EXP as float32 bits
    value = tl.where(magnitude < MIN_NORMAL_BITS, subnormal, normal)
    out = (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, out)
