"""GPU benchmark of the Triton paged-attention kernels at Llama-3-8B sizes (bf16, 32 query
heads, 8 KV heads, head dim 128, block size 16).

Decode (batch 1-256 x 1k/4k context: KV GB/s and its share of a 1 GiB copy's) and 2k-token
prefill chunks (TFLOP/s) against dense SDPA (and FlexAttention, --flex), outputs checked
first; triton.testing.do_bench medians.

    python -m benchmarks.kernels [--flex] [--json out.json]
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
    args: tuple  # query, kv_cache, metadata
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
    return 2 * src.numel() / bench_ms(lambda: dst.copy_(src)) / 1e6


def build(batch: int, context: int, q_len: int) -> PagedBatch:
    """`batch` sequences of `context` cached tokens plus `q_len` new ones, shuffled blocks."""
    seq_len = context + q_len
    cuda = {"device": "cuda"}
    per_seq = -(-seq_len // BLOCK_SIZE)
    shape = (2, batch * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kv_cache = torch.randn(shape, dtype=DTYPE, **cuda)
    block_table = torch.randperm(batch * per_seq, dtype=torch.int64, **cuda).view(batch, -1).int()
    positions = torch.arange(seq_len, **cuda)
    slots = block_table[:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    dense = kv_cache.view(2, -1, KV_HEADS, HEAD_DIM)[:, slots.flatten()]
    dense = dense.view(2, batch, seq_len, KV_HEADS, HEAD_DIM).transpose(2, 3).contiguous()
    query = torch.randn((batch * q_len, Q_HEADS, HEAD_DIM), dtype=DTYPE, **cuda)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, **cuda)
    starts = torch.arange(batch + 1, dtype=torch.int32, **cuda) * q_len
    metadata = AttentionMetadata.cached(block_table, seq_lens, starts)
    dense_q = query.view(batch, q_len, Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return PagedBatch((query, kv_cache, metadata), q_len, seq_len, dense_q, dense[0], dense[1])


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


def flex_ms(batch: PagedBatch) -> float | None:
    """FlexAttention's time over the dense keys/values (an optional baseline: None if it
    does not run here)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    offset = batch.max_seq_len - batch.max_query_len
    q, k, v = batch.dense_q, batch.dense_k, batch.dense_v

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    try:
        lengths = (batch.max_query_len, batch.max_seq_len)
        mask = create_block_mask(causal, None, None, *lengths, device="cuda")
        compiled = torch.compile(flex_attention, dynamic=False)
        return bench_ms(lambda: compiled(q, k, v, block_mask=mask, scale=SCALE, enable_gqa=True))
    except Exception as exc:
        print(f"  FlexAttention unavailable: {type(exc).__name__}: {exc}"[:300])
        return None


def check(batch: PagedBatch) -> None:
    """The benchmarked kernel must compute the same thing as the SDPA it is compared to."""
    got, expected = triton_fn(batch, None)(), sdpa_fn(batch)()
    if batch.max_query_len > 1:
        expected = expected.transpose(1, 2)
    expected = expected.reshape(got.shape)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


def decode_rows(copy_gbs: float, flex: bool) -> list[Row]:
    rows = []
    for context in (1024, 4096):
        for batch_size in (1, 16, 64, 256):
            batch = build(batch_size, context - 1, 1)
            kv_bytes = 2 * batch_size * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
            sdpa_ms = bench_ms(sdpa_fn(batch))
            flex_time = flex_ms(batch) if flex and (batch_size, context) == (64, 4096) else None
            case = f"decode b{batch_size} ctx{context}"
            check(batch)
            for variant, split in (("triton auto", None), ("split", True), ("single", False)):
                ms = bench_ms(triton_fn(batch, split))
                gbs = kv_bytes / ms / 1e6
                rows.append(Row(case, variant, ms, gbs, gbs / copy_gbs, None, sdpa_ms / ms))
                if flex_time is not None and split is None:
                    rows[-1].vs_flex = flex_time / ms
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
        check(batch)
        ms = bench_ms(triton_fn(batch, None))
        sdpa_ms = bench_ms(sdpa_fn(batch))
        row = Row(case, "triton", ms, tflops=flops / ms / 1e9, vs_sdpa=sdpa_ms / ms)
        if flex and (batch_size, context) == (1, 0):  # each FlexAttention shape compiles
            flex_time = flex_ms(batch)
            row.vs_flex = None if flex_time is None else flex_time / ms
        rows += [row, Row(case, "sdpa dense", sdpa_ms, tflops=flops / sdpa_ms / 1e9)]
    return rows


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
        report = {"device": name, "copy_gb_per_s": copy_gbs, "rows": [asdict(r) for r in rows]}
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
