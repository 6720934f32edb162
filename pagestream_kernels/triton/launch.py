"""Python wrappers of the Triton kernels, with pagestream_kernels/reference.py's exact signatures.

Launch parameters come from shape heuristics (`attention_config`), not autotuning: the
worker's shapes are known (decode rows vs prefill chunks, GQA group, head dim), and every
configuration it can pick is compiled ahead of time for sm_90 by `pagestream_kernels.triton.aot`,
which builds its launches through the same `*_launches` functions as the wrappers below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from pagestream_kernels.attention_metadata import AttentionMetadata
from pagestream_kernels.triton.fp8 import FP8_FORMATS, fp8_constexprs, inverse_scale
from pagestream_kernels.triton.reshape_and_cache import reshape_and_cache_kernel
from pagestream_kernels.triton.unified_attention import (
    reduce_segments_kernel,
    unified_attention_kernel,
)

# Split-KV decode: segments per sequence (a power of two: the reduce kernel loads them as one
# vector) and when to use it: decode-only batches with fewer (sequence, kv head) programs than
# SPLIT_KV_PROGRAMS_PER_SM per SM, and contexts long enough to cut into several tiles.
NUM_SEGMENTS = 16
SPLIT_KV_PROGRAMS_PER_SM = 4
SPLIT_KV_MIN_TILES = 4
# SM count assumed where no CUDA device says otherwise (the interpreter, AOT): an H100.
DEFAULT_NUM_SMS = 132
# KV cache dtypes the kernels read and write: floats, and fp8 with per-tensor k/v scales.
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_FORMATS)


@dataclass(frozen=True)
class AttentionConfig:
    """Compile-time shape of one paged-attention launch."""

    block_m: int  # rows per program: query tokens x GQA group, a power of two >= 16
    tile: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    split_kv: bool


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: runtime arguments in the kernel's order, constexprs, options."""

    kernel: Any  # a triton JITFunction (or the interpreter's InterpretedFunction)
    grid: tuple[int, ...]
    args: dict[str, Any]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int

    def __call__(self) -> None:
        self.kernel[self.grid](
            **self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages
        )


def head_dim_padded(head_dim: int) -> int:
    """Power of two >= 16 (the minimum tl.dot dimension)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def attention_config(
    head_dim: int,
    group_size: int,
    max_query_len: int,
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int | None,
    dtype: torch.dtype,
    num_sms: int = DEFAULT_NUM_SMS,
    split_kv: bool | None = None,
) -> AttentionConfig:
    """Pick the launch shape: small row blocks for decode, 64-row blocks for prefill.

    split_kv=None decides by the heuristic; True/False forces it (decode-only batches only).
    """
    padded = head_dim_padded(head_dim)
    # fp32 (ieee dot, no tensor cores) and 256-dim heads need narrow key tiles: wider ones
    # spill registers on sm_90 (pagestream_kernels.triton.aot shows it, Triton 3.6 to 3.9).
    wide = padded > 128 or dtype == torch.float32
    tile = 16 if dtype == torch.float32 else 32 if padded > 128 else 64
    group_rows = 1 << (group_size - 1).bit_length()
    decode = max_query_len <= 1
    block_m = max(16 if decode else 32 if padded > 128 else 64, group_rows)
    if split_kv is None:
        long_enough = max_seq_len is None or max_seq_len >= SPLIT_KV_MIN_TILES * tile
        few_programs = num_seqs * num_kv_heads < SPLIT_KV_PROGRAMS_PER_SM * num_sms
        split_kv = decode and long_enough and few_programs
    elif split_kv and not decode:
        raise ValueError("split-KV attention is for decode-only batches (max_query_len == 1).")
    # 4-warp prefill with fp32 or 256-dim heads spills or sits at 255 registers; 8 warps keep
    # it at ~80-150 registers without spills.
    num_warps = 8 if wide and not decode else 4
    num_stages = 2 if wide or not decode else 3
    return AttentionConfig(block_m, tile, num_warps, num_stages, split_kv)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def check_kv_cache(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """ValueError unless the kernels take this cache: a float or fp8 dtype, a contiguous last
    dimension, and (fp8) positive finite scales; a float cache takes only scales of 1."""
    if kv_cache.dtype not in CACHE_DTYPES:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in CACHE_DTYPES)
        raise ValueError(f"the Triton kernels take a KV cache of {names}, not {kv_cache.dtype}.")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dimension must be contiguous.")
    if kv_cache.dtype in FP8_FORMATS:
        inverse_scale(k_scale), inverse_scale(v_scale)
    elif (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError(
            f"k_scale / v_scale ({k_scale}, {v_scale}) apply to an fp8 KV cache only, "
            f"not to {kv_cache.dtype}."
        )


def reshape_and_cache_launches(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> list[KernelLaunch]:
    """The launches of `reshape_and_cache` (none for an empty step)."""
    check_kv_cache(kv_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if kv_cache.shape[3:] != key.shape[1:] or value.shape != key.shape:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit the cache "
            f"[2, blocks, block_size, {kv_cache.shape[3]}, {kv_cache.shape[4]}]."
        )
    if num_tokens == 0:
        return []
    key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
    fp8 = kv_cache.dtype in FP8_FORMATS
    args = {
        "key_ptr": key,
        "value_ptr": value,
        "key_cache_ptr": kv_cache[0],
        "value_cache_ptr": kv_cache[1],
        "slot_mapping_ptr": slot_mapping,
        "k_scale_inv": inverse_scale(k_scale) if fp8 else 1.0,
        "v_scale_inv": inverse_scale(v_scale) if fp8 else 1.0,
        "num_kv_heads": num_kv_heads,
        "stride_key_tok": key.stride(0),
        "stride_key_head": key.stride(1),
        "stride_value_tok": value.stride(0),
        "stride_value_head": value.stride(1),
        "stride_cache_block": kv_cache.stride(1),
        "stride_cache_slot": kv_cache.stride(2),
        "stride_cache_head": kv_cache.stride(3),
    }
    constexprs = {
        "BLOCK_SIZE": kv_cache.shape[2],
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PADDED": 1 << (head_dim - 1).bit_length(),
        "HEADS_PADDED": 1 << (num_kv_heads - 1).bit_length(),
        **fp8_constexprs(kv_cache.dtype),
    }
    return [KernelLaunch(reshape_and_cache_kernel, (num_tokens,), args, constexprs, 4, 1)]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots, in place (see reference.py);
    an fp8 cache stores them divided by k_scale / v_scale, saturated (triton/fp8.py)."""
    launches = reshape_and_cache_launches(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    for launch in launches:
        launch()


def paged_attention_launches(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    split_kv: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor,
) -> list[KernelLaunch]:
    """The launches of `paged_attention` writing into ``out`` (none for an empty batch).
    An fp8 cache reads back as stored * k_scale / v_scale: k_scale folds into the softmax
    scale, v_scale multiplies the output (both are per tensor)."""
    check_kv_cache(kv_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, num_seqs = kv_cache.shape[3], metadata.num_seqs
    block_table = metadata.block_table
    group_size = num_q_heads // num_kv_heads
    config = attention_config(
        head_dim,
        group_size,
        metadata.max_query_len,
        num_seqs,
        num_kv_heads,
        metadata.max_seq_len,
        query.dtype,
        _num_sms(query.device),
        split_kv,
    )
    padded = head_dim_padded(head_dim)
    block_q = config.block_m // group_size
    segments = NUM_SEGMENTS if config.split_kv else 1
    segm_out = segm_max = segm_sum = out  # placeholders: only the split kernel writes them
    if config.split_kv:
        partial = (num_tokens, num_q_heads, segments)
        segm_out = torch.empty((*partial, padded), dtype=torch.float32, device=query.device)
        segm_max = torch.empty(partial, dtype=torch.float32, device=query.device)
        segm_sum = torch.empty(partial, dtype=torch.float32, device=query.device)
    args = {
        "out_ptr": out,
        "query_ptr": query,
        "key_cache_ptr": kv_cache[0],
        "value_cache_ptr": kv_cache[1],
        "block_table_ptr": block_table,
        "seq_lens_ptr": metadata.seq_lens,
        "query_start_loc_ptr": metadata.query_start_loc,
        "segm_out_ptr": segm_out,
        "segm_max_ptr": segm_max,
        "segm_sum_ptr": segm_sum,
        "scale": float(scale) * float(k_scale),
        "v_scale": float(v_scale),
        "soft_cap": float(soft_cap or 1.0),
        "sliding_window": int(sliding_window or 0),
        "num_seqs": num_seqs,
        "num_q_heads": num_q_heads,
        "group_size": group_size,
        "block_q": block_q,
        "stride_q_tok": query.stride(0),
        "stride_q_head": query.stride(1),
        "stride_o_tok": out.stride(0),
        "stride_o_head": out.stride(1),
        "stride_cache_block": kv_cache.stride(1),
        "stride_cache_slot": kv_cache.stride(2),
        "stride_cache_head": kv_cache.stride(3),
        "stride_block_table": block_table.stride(0),
    }
    constexprs = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PADDED": padded,
        "BLOCK_SIZE": kv_cache.shape[2],
        "TILE": config.tile,
        "BLOCK_M": config.block_m,
        "NUM_SEGMENTS": segments,
        "SPLIT_KV": config.split_kv,
        "USE_SOFTCAP": soft_cap is not None,
        "USE_SLIDING_WINDOW": sliding_window is not None,
        "IEEE_DOT": query.dtype == torch.float32,
    }
    grid = (num_tokens // block_q + num_seqs, num_kv_heads) + ((segments,) if segments > 1 else ())
    launches = [
        KernelLaunch(
            unified_attention_kernel, grid, args, constexprs, config.num_warps, config.num_stages
        )
    ]
    if config.split_kv:
        launches.append(_reduce_launch(out, segm_out, segm_max, segm_sum, args, constexprs))
    return launches


def _reduce_launch(
    out: torch.Tensor,
    segm_out: torch.Tensor,
    segm_max: torch.Tensor,
    segm_sum: torch.Tensor,
    attention_args: dict[str, Any],
    attention_constexprs: dict[str, Any],
) -> KernelLaunch:
    args = {
        "out_ptr": out,
        "segm_out_ptr": segm_out,
        "segm_max_ptr": segm_max,
        "segm_sum_ptr": segm_sum,
        "seq_lens_ptr": attention_args["seq_lens_ptr"],
        "query_start_loc_ptr": attention_args["query_start_loc_ptr"],
        "num_seqs": attention_args["num_seqs"],
        "num_q_heads": attention_args["num_q_heads"],
        "stride_o_tok": out.stride(0),
        "stride_o_head": out.stride(1),
    }
    constexprs = {
        name: attention_constexprs[name]
        for name in ("HEAD_DIM", "HEAD_DIM_PADDED", "TILE", "NUM_SEGMENTS")
    }
    grid = (out.shape[0], out.shape[1])
    return KernelLaunch(reduce_segments_kernel, grid, args, constexprs, 4, 1)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal varlen attention over the paged cache (see reference.paged_attention);
    the metadata's max_query_len / max_seq_len (host ints) pick the kernel's tiling.
    An fp8 cache is upcast to the query's dtype in the kernel and scaled by k_scale / v_scale."""
    return run_paged_attention(
        query,
        kv_cache,
        metadata,
        scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def run_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    split_kv: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`paged_attention` with split-KV forced on/off (tests, benchmarks) or heuristic (None)."""
    if query.shape[1] % kv_cache.shape[3] != 0:
        raise ValueError(
            f"num_q_heads ({query.shape[1]}) must be a multiple of num_kv_heads "
            f"({kv_cache.shape[3]})."
        )
    check_kv_cache(kv_cache, k_scale, v_scale)
    query = _last_dim_contiguous(query)
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    if metadata.num_seqs == 0 or query.shape[0] == 0:
        return out
    for launch in paged_attention_launches(
        query,
        kv_cache,
        metadata,
        scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        split_kv=split_kv,
        k_scale=k_scale,
        v_scale=v_scale,
        out=out,
    ):
        launch()
    return out
