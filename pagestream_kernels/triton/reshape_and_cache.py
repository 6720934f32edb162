"""Triton kernel writing a step's new keys and values into their paged-cache slots.

One program per token copies all of its KV heads (``[num_kv_heads, head_dim]``) to slot
``slot_mapping[token]`` (``block_id * BLOCK_SIZE + offset``); a negative slot is skipped.
Strides are explicit and int64, so any layout with a contiguous last dimension works.
An fp8 cache (FP8) stores ``key * (1 / k_scale)`` and ``value * (1 / v_scale)`` (a float32
multiply by the host's reciprocal: Triton's float32 ``/`` is not correctly rounded on GPUs)
rounded to nearest-even and saturated to the format's largest value (triton/fp8.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagestream_kernels.triton.fp8 import round_to_fp8_grid


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    k_scale_inv,  # fp8 only: the cache holds key * k_scale_inv (1 / k_scale in float32)
    v_scale_inv,
    num_kv_heads,
    stride_key_tok: tl.int64,
    stride_key_head: tl.int64,
    stride_value_tok: tl.int64,
    stride_value_head: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANTISSA: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    cache_offset = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )
    key_row = key_ptr + token * stride_key_tok
    key = tl.load(key_row + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask)
    if FP8:
        key = round_to_fp8_grid(
            key.to(tl.float32) * k_scale_inv, FP8_MAX, FP8_MANTISSA, FP8_MIN_EXP
        )
    tl.store(key_cache_ptr + cache_offset, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(
        value_ptr
        + token * stride_value_tok
        + offs_h[:, None] * stride_value_head
        + offs_d[None, :],
        mask=mask,
    )
    if FP8:
        value = round_to_fp8_grid(
            value.to(tl.float32) * v_scale_inv, FP8_MAX, FP8_MANTISSA, FP8_MIN_EXP
        )
    tl.store(value_cache_ptr + cache_offset, value.to(value_cache_ptr.dtype.element_ty), mask=mask)
