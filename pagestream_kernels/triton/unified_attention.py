"""Varlen paged attention in one Triton kernel, in the style of vLLM's unified attention.

One program attends one query block of one sequence for one KV head: ``BLOCK_Q`` query
tokens times the ``group_size`` heads sharing the KV head, so each K/V tile is read once
per GQA group; the first grid axis spans the whole flattened batch (each program finds its
sequence by binary search), so prefill, chunked prefill and decode share one launch.
Split-KV cuts a context into segments that ``reduce_segments_kernel`` merges (small decode
batches). An fp8 cache's tiles are upcast to the query's dtype before each dot.
Triton 3.6-3.9: no block pointers, no libdevice, int64 offsets, masked loads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target, num_seqs, block_q):
    """Largest ``i < num_seqs`` with ``query_start_loc[i] // block_q + i <= target``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if start // block_q + mid <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _find_token_seq(query_start_loc_ptr, token, num_seqs):
    """Largest ``i < num_seqs`` with ``query_start_loc[i] <= token``: the token's sequence."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _soft_cap(scores, cap):
    """``cap * tanh(scores / cap)`` without libdevice: tanh(x) = 1 - 2 / (exp(2x) + 1)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))


@triton.jit(do_not_specialize=["num_seqs"])
def unified_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    segm_out_ptr,  # SPLIT_KV: [num_tokens, num_q_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32
    segm_max_ptr,  # SPLIT_KV: [num_tokens, num_q_heads, NUM_SEGMENTS] fp32
    segm_sum_ptr,  # SPLIT_KV: [num_tokens, num_q_heads, NUM_SEGMENTS] fp32
    scale,  # softmax scale times k_scale (an fp8 cache's keys read back as stored * k_scale)
    v_scale,  # an fp8 cache's values read back as stored * v_scale; 1.0 otherwise
    soft_cap,
    sliding_window,
    num_seqs,
    num_q_heads,
    group_size,
    block_q,  # query tokens per program: BLOCK_M // group_size
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_slot: tl.int64,
    stride_cache_head: tl.int64,
    stride_block_table: tl.int64,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SLIDING_WINDOW: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq_idx(query_start_loc_ptr, q_block, num_seqs, block_q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_first = (q_block - (q_start // block_q + seq)) * block_q  # first query of this block
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Key range of the whole block: causal end, sliding-window start.
    kv_end = context_len + tl.minimum(q_first + block_q, q_len)  # exclusive
    kv_start = 0
    if USE_SLIDING_WINDOW:
        kv_start = tl.maximum(context_len + q_first - sliding_window + 1, 0)
    tile_lo = kv_start // TILE
    tile_hi = tl.cdiv(kv_end, TILE)
    segment = 0
    if SPLIT_KV:
        segment = tl.program_id(2)
        tiles_per_segment = tl.cdiv(tl.cdiv(seq_len, TILE), NUM_SEGMENTS)
        if segment * tiles_per_segment * TILE >= seq_len:
            return  # past the context: reduce_segments ignores this segment
        tile_lo = tl.maximum(tile_lo, segment * tiles_per_segment)
        tile_hi = tl.minimum(tile_hi, (segment + 1) * tiles_per_segment)

    # Rows: (query token, head within the GQA group), token-major.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_t = tl.arange(0, TILE)
    q_idx = q_first + offs_m // group_size  # query index within the sequence
    head = kv_head * group_size + offs_m % group_size
    row_valid = (offs_m < block_q * group_size) & (q_idx < q_len)
    dim_valid = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_abs = context_len + q_idx  # absolute position of each row's query token

    q_ptrs = query_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_block_table
    head_offset = kv_head.to(tl.int64) * stride_cache_head

    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE + offs_t
        kv_valid = kv_pos < kv_end
        block_id = tl.load(block_table_row + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0)
        slot = (
            block_id.to(tl.int64) * stride_cache_block
            + (kv_pos % BLOCK_SIZE).to(tl.int64) * stride_cache_slot
            + head_offset
        )  # [TILE] int64 element offsets
        k = tl.load(
            key_cache_ptr + slot[None, :] + offs_d[:, None],
            mask=dim_valid[:, None] & kv_valid[None, :],
            other=0.0,
        )  # [HEAD_DIM_PADDED, TILE]
        v = tl.load(
            value_cache_ptr + slot[:, None] + offs_d[None, :],
            mask=kv_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [TILE, HEAD_DIM_PADDED]
        if IEEE_DOT:
            s = tl.dot(q, k.to(q.dtype), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        s = s * scale
        if USE_SOFTCAP:
            s = _soft_cap(s, soft_cap)
        allowed = row_valid[:, None] & (kv_pos[None, :] <= q_abs[:, None])
        if USE_SLIDING_WINDOW:
            allowed = allowed & (kv_pos[None, :] > q_abs[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))

        # Online softmax; a row with no allowed key so far keeps m = -inf, l = 0, acc = 0.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE_DOT:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc * v_scale  # per tensor, so it commutes with the softmax weighting

    if SPLIT_KV:
        part = (token * num_q_heads + head) * NUM_SEGMENTS + segment  # [BLOCK_M] int64
        tl.store(
            segm_out_ptr + part[:, None] * HEAD_DIM_PADDED + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
        tl.store(segm_max_ptr + part, m_i, mask=row_valid)
        tl.store(segm_sum_ptr + part, l_i, mask=row_valid)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_ptrs = out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head
        tl.store(
            o_ptrs + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@triton.jit(do_not_specialize=["num_seqs"])
def reduce_segments_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    segm_out_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32
    segm_max_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS] fp32
    segm_sum_ptr,  # [num_tokens, num_q_heads, NUM_SEGMENTS] fp32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    num_q_heads,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Merge the split-KV partial results of one (query token, query head)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_token_seq(query_start_loc_ptr, token, num_seqs)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles_per_segment = tl.cdiv(tl.cdiv(seq_len, TILE), NUM_SEGMENTS)
    num_active = tl.cdiv(seq_len, tiles_per_segment * TILE)  # segments that stored a result

    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    active = offs_s < num_active
    part = (token.to(tl.int64) * num_q_heads + head) * NUM_SEGMENTS + offs_s
    segm_max = tl.load(segm_max_ptr + part, mask=active, other=float("-inf"))
    segm_sum = tl.load(segm_sum_ptr + part, mask=active, other=0.0)
    max_all = tl.max(segm_max, 0)
    max_all = tl.where(max_all == float("-inf"), 0.0, max_all)
    weight = tl.exp(segm_max - max_all)  # 0 for inactive / empty segments
    total = tl.sum(segm_sum * weight, 0)
    acc = tl.load(
        segm_out_ptr + part[:, None] * HEAD_DIM_PADDED + offs_d[None, :],
        mask=active[:, None],
        other=0.0,
    )
    o = tl.sum(acc * weight[:, None], 0)
    o = o / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + token.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
