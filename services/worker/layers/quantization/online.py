"""Online weight-only quantization: float linear weights [N, K] -> QuantizedWeight at load.

`quantize_int8`: symmetric, one scale per output channel (max |w_row| / 127), codes
-127..127. `quantize_int4`: per group of 32 or 128, codes 0..15 over [min(lo, 0),
max(hi, 0)] in 15 steps (0.0 exactly a code, none clamped), float32 scales and mins =
-scale * zero; a constant group c has scale |c|, a zero group scale 1. Both compute in
float32, a block of rows at a time (the working copy stays under `CHUNK_BYTES`).
"""

from __future__ import annotations

import torch

from services.worker.layers.quantization.quantized_weight import QuantizedWeight, pack_int4

CHUNK_BYTES = 32 << 20  # the float32 working copy of a block of rows (and a uint8 quarter)
INT4_GROUP_SIZES = (32, 128)


def _check_weight(weight: torch.Tensor) -> tuple[int, int]:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got {getattr(weight, 'shape', weight)}")
    if not weight.is_floating_point():
        raise ValueError(f"expected a floating-point weight, got {weight.dtype}")
    n, k = weight.shape
    if k == 0:
        raise ValueError("the weight has no input features (K = 0)")
    return n, k


def _row_chunks(n: int, k: int) -> range:
    """Starts of blocks of rows whose float32 copy [rows, K] fits CHUNK_BYTES."""
    return range(0, n, _rows_per_chunk(k))


def _rows_per_chunk(k: int) -> int:
    return max(1, CHUNK_BYTES // (4 * k))


def _check_finite(lo: torch.Tensor, hi: torch.Tensor, start: int) -> None:
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError(f"the weight has non-finite values (in rows from {start})")


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """weight [N, K] float -> int8 codes [N, K], float32 scales [N, 1] (group_size K).

    scale = max |w_row| / 127 (1 for a row of zeros), code = round(w / scale) in -127..127,
    so |w - scale * code| <= scale / 2 (up to float32 rounding).
    """
    n, k = _check_weight(weight)
    codes = torch.empty(n, k, dtype=torch.int8, device=weight.device)
    scales = torch.empty(n, 1, dtype=torch.float32, device=weight.device)
    rows = _rows_per_chunk(k)
    for start in _row_chunks(n, k):
        w = weight[start : start + rows].to(torch.float32, copy=True)  # [r, K]
        lo, hi = w.aminmax(dim=1)  # [r]
        _check_finite(lo, hi, start)
        scale = torch.maximum(lo.abs(), hi) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # [r]
        w.div_(scale[:, None]).round_().clamp_(-127, 127)
        codes[start : start + rows].copy_(w)
        scales[start : start + rows, 0] = scale
    return QuantizedWeight(codes, scales, None, k, 8, "int8")


def _int4_group_params(g: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups [r, G, gs] float32 -> (scale, zero), each [r, G] float32 (zero a whole 0..15)."""
    gmin, gmax = g.aminmax(dim=-1)  # [r, G]
    _check_finite(gmin, gmax, start)
    lo, hi = gmin.clamp(max=0), gmax.clamp(min=0)
    scale = hi / 15 - lo / 15  # (hi - lo) / 15 without overflow
    constant = gmin == gmax
    scale = torch.where(constant, gmax.abs(), scale)  # c = |c| * 1 or -|c| * 1, exactly
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = (-lo / scale).round().clamp(0, 15)
    return scale, zero


def quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    """weight [N, K] float -> 4-bit codes uint8 [N, K // 2], float32 scales and mins
    [N, K // group_size] (group_size 32 or 128, dividing K).

    Per group: scale = (max(hi, 0) - min(lo, 0)) / 15, zero = round(-min(lo, 0) / scale),
    code = clamp(round(w / scale) + zero, 0, 15), mins = -scale * zero; so
    |w - (scale * code + mins)| <= scale / 2 (up to float32 rounding).
    """
    n, k = _check_weight(weight)
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(
            f"int4 group_size {group_size!r} must be one of {INT4_GROUP_SIZES} and divide K = {k}"
        )
    groups = k // group_size
    codes = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, groups, dtype=torch.float32, device=weight.device)
    mins = torch.empty_like(scales)
    rows = _rows_per_chunk(k)
    for start in _row_chunks(n, k):
        w = weight[start : start + rows].to(torch.float32, copy=True)
        g = w.view(-1, groups, group_size)  # [r, G, gs]
        scale, zero = _int4_group_params(g, start)
        g.div_(scale[..., None]).round_().add_(zero[..., None]).clamp_(0, 15)
        codes[start : start + rows] = pack_int4(w.to(torch.uint8))
        scales[start : start + rows] = scale
        mins[start : start + rows] = -scale * zero
    return QuantizedWeight(codes, scales, mins, group_size, 4, "int4")
