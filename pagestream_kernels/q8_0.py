"""The q8_0 KV cache layout (llama.cpp's `-ctk q8_0 -ctv q8_0`): each head's vector of
head_dim values is stored as head_dim int8 codes followed by head_dim / 32 float16 scales,
one per 32 consecutive values, in one uint8 row of `row_bytes(head_dim)` = 34 / 32 bytes a
value. A cache [2, blocks, block_size, kv_heads, row_bytes] of uint8 keeps each block
self-contained, so block copies, swaps and the offload tiers move raw bytes unchanged.

Quantization per 32 values x: d = max|x| / 127, codes = round(x / d) (half away from zero,
as C's roundf, with the float32 d; d = 0 gives codes 0), and d is stored as float16;
dequantized = code * float(fp16 d), exact in float32. The C++ writer (cpu/q8_0.h) is
bit-exact with `quantize`; the attention kernels read `dequantize`'s values.
"""

from __future__ import annotations

import torch

GROUP = 32  # values per scale
_SCALE_BYTES = 2  # one float16 per group


def row_bytes(head_dim: int) -> int:
    """Bytes one head's vector takes: head_dim codes + head_dim / 32 float16 scales."""
    check_head_dim(head_dim)
    return head_dim + head_dim // GROUP * _SCALE_BYTES


def head_dim_of(row_width: int) -> int:
    """The head_dim whose q8_0 rows are `row_width` bytes (34 bytes per 32 values)."""
    group_bytes = GROUP + _SCALE_BYTES
    if row_width < group_bytes or row_width % group_bytes:
        raise ValueError(f"a q8_0 cache row of {row_width} bytes is no whole number of groups")
    return row_width // group_bytes * GROUP


def check_head_dim(head_dim: int) -> None:
    if head_dim < GROUP or head_dim % GROUP:
        raise ValueError(
            f"--kv-cache-dtype q8_0 needs a head_dim that is a multiple of {GROUP} (one scale "
            f"per {GROUP} values); this model's head_dim is {head_dim}: use auto or a float dtype"
        )


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """roundf: torch.round rounds ties to even; the ties (x - trunc(x) = +-0.5, exact) go
    away from zero instead."""
    whole = torch.trunc(x)
    tie = (x - whole).abs() == 0.5
    return torch.where(tie, whole + torch.sign(x), torch.round(x))


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., row_bytes(head_dim)] uint8 q8_0 rows."""
    head_dim = x.shape[-1]
    check_head_dim(head_dim)
    groups = x.float().reshape(*x.shape[:-1], head_dim // GROUP, GROUP)  # [..., G, 32]
    # A group with a NaN or an infinity: codes 0 and a NaN scale (it reads back as NaN).
    finite = torch.isfinite(groups).all(dim=-1, keepdim=True)  # [..., G, 1]
    peak = torch.where(finite, groups.abs(), 0.0).amax(dim=-1, keepdim=True)
    scale = torch.where(finite, peak / 127.0, float("nan"))  # [..., G, 1] float32
    inverse = torch.where(finite & (scale > 0), 1.0 / scale, 0.0)
    scaled = torch.where(finite, groups * inverse, 0.0)
    codes = _round_half_away(scaled).to(torch.int8)  # |code| <= 127
    codes = codes.reshape(*x.shape[:-1], head_dim).view(torch.uint8)
    scales = scale.squeeze(-1).to(torch.float16).contiguous().view(torch.uint8)  # [..., 2G]
    return torch.cat([codes, scales], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., row_bytes] uint8 q8_0 rows -> [..., head_dim] values (exact in float32)."""
    head_dim = head_dim_of(rows.shape[-1])
    codes = rows[..., :head_dim].contiguous().view(torch.int8).float()
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float()  # [..., G]
    groups = codes.reshape(*codes.shape[:-1], head_dim // GROUP, GROUP) * scales[..., None]
    return groups.reshape(codes.shape).to(dtype)
