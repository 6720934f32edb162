"""GPU benchmark of the Triton paged-attention kernels at Llama-3-8B sizes (bf16, 32 query
heads, 8 KV heads, head dim 128, block size 16).

Decode at batch 1/16/64/256 x context 1k/4k: time, effective KV read bandwidth (K and V
bytes of every context token / time) as a share of this GPU's measured device-to-device copy
bandwidth ((read + write) / time of a 1 GiB copy), the split-KV and single-pass variants, and
the ratio to dense SDPA over the same keys/values stored contiguously (FlexAttention too at
batch 64 x 4k, with --flex). Prefill of 2k-token chunks (a 2k prompt, four 2k prompts, a 2k
chunk over 6k cached tokens): time, causal TFLOP/s and the ratio to SDPA (FlexAttention: the
2k prompt). The kernel's output is checked against the baseline's before timing.
Goal (issue 7): decode at batch 64 x 4k reaches >= 70% of the copy bandwidth.

    python -m benchmarks.kernels [--flex] [--json out.json]

Timings: triton.testing.do_bench (median, L2 flushed between runs). Needs CUDA + triton.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pagestream_kernels.attention_metadata import AttentionMetadata

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5


@dataclass
class Row:
    case: str
    variant: str
    ms: float
    kv_gb_per_s: float | None = None
    copy_share: float | None = None
    tflops: float | None = None
    vs_sdpa: float | None = None  # SDPA time / this time (> 1: faster than SDPA)
    vs_flex: float | None = None


@dataclass
class PagedBatch:
    args: tuple[torch.Tensor, ...]  # query, kv_cache, block_table, seq_lens, query_start_loc
    max_query_len: int
    max_seq_len: int
    dense_q: torch.Tensor  # [B, Q_HEADS, q_len, D] (equal query lengths)
    dense_k: torch.Tensor  # [B, KV_HEADS, L, D], the cached keys contiguous
    dense_v: torch.Tensor


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def copy_bandwidth_gb_per_s() -> float:
    """Device-to-device copy of 1 GiB: (read + write) bytes / time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def build(batch: int, context: int, q_len: int) -> PagedBatch:
    """`batch` sequences of `context` cached tokens plus `q_len` new ones, shuffled blocks."""
    seq_len = context + q_len
    per_seq = -(-seq_len // BLOCK_SIZE)
    kv_cache = torch.randn(
        (2, batch * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM), device="cuda", dtype=DTYPE
    )
    perm = torch.randperm(batch * per_seq, device="cuda", dtype=torch.int64)
    block_table = perm.view(batch, per_seq).int()
    positions = torch.arange(seq_len, device="cuda")
    slots = block_table[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    flat = kv_cache.view(2, -1, KV_HEADS, HEAD_DIM)
    dense = flat[:, slots.flatten()].view(2, batch, seq_len, KV_HEADS, HEAD_DIM)
    dense = dense.transpose(2, 3).contiguous()  # [2, B, KV_HEADS, L, D]
    query = torch.randn((batch * q_len, Q_HEADS, HEAD_DIM), device="cuda", dtype=DTYPE)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    dense_q = query.view(batch, q_len, Q_HEADS, HEAD_DIM).transpose(1, 2)
    return PagedBatch(
        args=(query, kv_cache, AttentionMetadata.cached(block_table, seq_lens, starts)),
        max_query_len=q_len,
        max_seq_len=seq_len,
        dense_q=dense_q.contiguous(),
        dense_k=dense[0],
        dense_v=dense[1],
    )


def triton_fn(batch: PagedBatch, split_kv: bool | None) -> Callable[[], torch.Tensor]:
    from pagestream_kernels.triton.launch import run_paged_attention

    return lambda: run_paged_attention(*batch.args, SCALE, split_kv=split_kv)


def sdpa_fn(batch: PagedBatch) -> Callable[[], torch.Tensor]:
    """Dense SDPA, GQA folded into query rows for decode; bottom-right causal for prefill."""
    q, k, v = batch.dense_q, batch.dense_k, batch.dense_v
    group = Q_HEADS // KV_HEADS
    if batch.max_query_len == 1:
        rows = q.view(q.shape[0], KV_HEADS, group, HEAD_DIM)  # [B, KV_HEADS, group, D]
        return lambda: F.scaled_dot_product_attention(rows, k, v, scale=SCALE)
    if batch.max_query_len == batch.max_seq_len:
        return lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=SCALE, enable_gqa=True
        )
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(batch.max_query_len, batch.max_seq_len)
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=bias, scale=SCALE)


def flex_fn(batch: PagedBatch) -> Callable[[], torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    offset = batch.max_seq_len - batch.max_query_len

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    mask = create_block_mask(
        causal, None, None, batch.max_query_len, batch.max_seq_len, device="cuda"
    )
    compiled = torch.compile(flex_attention, dynamic=False)
    q, k, v = batch.dense_q, batch.dense_k, batch.dense_v
    return lambda: compiled(q, k, v, block_mask=mask, scale=SCALE, enable_gqa=True)


def check(batch: PagedBatch, got: torch.Tensor, expected: torch.Tensor) -> None:
    """The benchmarked kernel must compute the same thing as the baseline it is compared to."""
    if batch.max_query_len == 1:
        expected = expected.reshape(got.shape)
    else:
        expected = expected.transpose(1, 2).reshape(got.shape)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


def decode_rows(copy_gbs: float, flex: bool) -> list[Row]:
    rows = []
    for context in (1024, 4096):
        for batch_size in (1, 16, 64, 256):
            batch = build(batch_size, context - 1, 1)
            kv_bytes = 2 * batch_size * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
            sdpa_ms = bench_ms(sdpa_fn(batch))
            flex_ms = _flex_ms(batch) if flex and (batch_size, context) == (64, 4096) else None
            case = f"decode b{batch_size} ctx{context}"
            check(batch, triton_fn(batch, None)(), sdpa_fn(batch)())
            for variant, split in (("triton auto", None), ("split", True), ("single", False)):
                ms = bench_ms(triton_fn(batch, split))
                gbs = kv_bytes / ms / 1e6
                rows.append(Row(case, variant, ms, gbs, gbs / copy_gbs, None, sdpa_ms / ms))
                if flex_ms is not None and split is None:
                    rows[-1].vs_flex = flex_ms / ms
            rows.append(Row(case, "sdpa dense", sdpa_ms, kv_bytes / sdpa_ms / 1e6))
            del batch
            torch.cuda.empty_cache()
    return rows


def prefill_rows(flex: bool) -> list[Row]:
    rows = []
    for batch_size, context, q_len in ((1, 0, 2048), (4, 0, 2048), (1, 6144, 2048)):
        batch = build(batch_size, context, q_len)
        pairs = batch_size * (q_len * context + q_len * (q_len + 1) / 2)
        flops = 4 * pairs * Q_HEADS * HEAD_DIM
        case = f"prefill b{batch_size} q{q_len} ctx{context}"
        check(batch, triton_fn(batch, None)(), sdpa_fn(batch)())
        ms = bench_ms(triton_fn(batch, None))
        sdpa_ms = bench_ms(sdpa_fn(batch))
        row = Row(case, "triton", ms, tflops=flops / ms / 1e9, vs_sdpa=sdpa_ms / ms)
        if flex and (batch_size, context) == (1, 0):  # each FlexAttention shape compiles
            flex_ms = _flex_ms(batch)
            row.vs_flex = None if flex_ms is None else flex_ms / ms
        rows += [row, Row(case, "sdpa dense", sdpa_ms, tflops=flops / sdpa_ms / 1e9)]
    return rows


def _flex_ms(batch: PagedBatch) -> float | None:
    try:
        return bench_ms(flex_fn(batch))
    except Exception as exc:  # FlexAttention is an optional baseline
        print(f"  FlexAttention unavailable: {type(exc).__name__}: {exc}"[:300])
        return None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flex", action="store_true", help="also time FlexAttention")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA device")
    import triton

    copy_gbs = copy_bandwidth_gb_per_s()
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"measured copy bandwidth: {copy_gbs:.0f} GB/s")
    rows = decode_rows(copy_gbs, args.flex) + prefill_rows(args.flex)
    header = f"{'case':30s} {'variant':12s} {'ms':>8s} {'KV GB/s':>8s} {'of copy':>7s}"
    print(header + f" {'TFLOP/s':>8s} {'vs SDPA':>8s} {'vs flex':>8s}")
    for r in rows:
        print(
            f"{r.case:30s} {r.variant:12s} {r.ms:8.3f} {_fmt(r.kv_gb_per_s, '8.0f')} "
            f"{_fmt(r.copy_share, '7.0%')} {_fmt(r.tflops, '8.1f')} "
            f"{_fmt(r.vs_sdpa, '8.2f')} {_fmt(r.vs_flex, '8.2f')}"
        )
    goal = next(r for r in rows if r.case == "decode b64 ctx4096" and r.variant == "triton auto")
    verdict = "meets" if goal.copy_share >= 0.7 else "MISSES"
    print(f"decode b64 x 4k: {goal.copy_share:.0%} of copy bandwidth ({verdict} the 70% goal)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"device": name, "copy_gb_per_s": copy_gbs, "rows": [asdict(r) for r in rows]},
                handle,
                indent=1,
            )


if __name__ == "__main__":
    main()
