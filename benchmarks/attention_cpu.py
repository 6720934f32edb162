"""CPU timings of the torch paged attention on realistic varlen mixes (SmolLM2-135M shapes).

Compares the shipped grouping (decode sequences sorted by length in groups of about
DECODE_GROUP_TOKENS padded keys, prefills in groups of PREFILL_GROUP_AREA query x key pairs)
with the forms it was chosen over, by changing the module's two budgets:

  grouped       the defaults (8192 decode tokens, 32768 prefill pairs)
  per-seq loop  every sequence alone (budgets 1): a Python loop of one SDPA per sequence
  one-padded    one padded batch of all decode rows plus one of all prefill rows
  decode-4k/16k other decode budgets
  c++ decode    the shipped grouping, decode groups in the C++ kernel (the CPU default)

    .venv/bin/python -m benchmarks.attention_cpu [--repeats 15] [--threads N] [--mallopt]
    .venv/bin/python -m benchmarks.attention_cpu --bandwidth --mallopt  # the kernel GB/s

``--mallopt`` turns off glibc's returning of freed memory to the OS (as a long-running
worker would); without it, multi-MiB buffers are fresh pages on every call and page faults
dominate and vary a lot on a small VM.

Measured (2-core AMD EPYC VM, torch 2.13 CPU, 2 threads, --mallopt, median ms per call):

  batch                                  dtype     grouped  per-seq  one-padded  dec-4k  dec-16k
  64 decode (ctx 300-800) + 512 prefill  float32      14.0     26.6        19.1    14.1     16.0
  64 decode (ctx 300-800)                float32       9.2     21.6        14.3    10.3     11.8
  256 decode (ctx 100-2000)              float32      64.0    115.6       343.6    70.5     77.9
  32 decode + 4 chunks on context        float32      24.5     30.5        63.3    24.7     25.8
  32 prompts (20-60 tokens)              float32       4.3     10.7         5.9     4.7      4.5
  one 512-token prompt                   float32       4.9      4.9         4.9     4.9      4.9
  64 decode (ctx 300-800) + 512 prefill  bfloat16     11.8     25.1        15.7    12.5     12.8
  64 decode (ctx 300-800)                bfloat16      6.6     19.9        10.8     7.9      8.5
  256 decode (ctx 100-2000)              bfloat16     48.5    103.4       162.0    58.0     51.3
  32 decode + 4 chunks on context        bfloat16     23.6     29.8        60.4    23.9     24.1

The C++ decode kernel against the grouped torch form, measured side by side afterwards (same VM,
float32, --mallopt, median ms): 64 decode + 512 prefill 12.9 -> 10.3; 64 decode 8.2 -> 5.2;
256 decode (ctx 100-2000) 54.1 -> 41.1; 32 decode + 4 chunks 23.1 -> 21.6; prompts unchanged
(they take the same SDPA path); bfloat16 is unchanged (the kernel is float32-only). The kernel
alone on one group of 64 sequences x 550 tokens: 4.1 ms on 2 threads, 8.4 ms on one.

Without --mallopt the grouped form is at most 1.3x slower; one-padded gets 2-3x worse (its buffers
exceed glibc's 32 MiB mmap ceiling, so every call page-faults fresh memory). Of the 9.2 ms for
64 decode rows (fp32), ~45% is the flash SDPA kernel and ~40% the K/V gather (index_select,
memory bound); planning and masks are the rest. Other layouts measured slower: gathering
straight into [B, kv_heads, L, hd] (5-30x), explicit matmul+softmax instead of SDPA (1.3-1.7x),
SDPA with enable_gqa instead of folding the query groups into rows (1.5x).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics

import torch

from benchmarks.micro import interleaved, read_bandwidth_gb_s
from pagestream_kernels import cpu, reference
from pagestream_kernels.attention_metadata import AttentionMetadata
from pagestream_kernels.reference import paged_attention, reshape_and_cache
from services.worker.cpu_tuning import tune_malloc

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
VARIANTS = {  # name: (DECODE_GROUP_TOKENS, PREFILL_GROUP_AREA)
    "grouped": (reference.DECODE_GROUP_TOKENS, reference.PREFILL_GROUP_AREA),
    "per-seq loop": (1, 1),
    "one-padded": (10**12, 10**12),
    "decode-4k": (4096, reference.PREFILL_GROUP_AREA),
    "decode-16k": (16384, reference.PREFILL_GROUP_AREA),
    # The shipped grouping, decode groups in C++ (pagestream_kernels/cpu, --attention-backend cpu).
    "c++ decode": (reference.DECODE_GROUP_TOKENS, reference.PREFILL_GROUP_AREA),
}


def mixes() -> dict[str, list[tuple[int, int]]]:
    """Named batches as (cached context tokens, query tokens) per sequence."""
    rng = random.Random(0)

    def decode(n: int, lo: int, hi: int) -> list[tuple[int, int]]:
        return [(rng.randint(lo, hi) - 1, 1) for _ in range(n)]

    return {
        "64 decode (ctx 300-800) + 512 prefill": [*decode(64, 300, 800), (0, 512)],
        "64 decode (ctx 300-800)": decode(64, 300, 800),
        "256 decode (ctx 100-2000)": decode(256, 100, 2000),
        "32 decode + 4 chunks on context": [
            *decode(32, 300, 800),
            *[(0, 64), (256, 128), (512, 256), (1024, 512)],
        ],
        "32 prompts (20-60 tokens)": [(0, rng.randint(20, 60)) for _ in range(32)],
        "one 512-token prompt": [(0, 512)],
    }


def build(specs: list[tuple[int, int]], dtype: torch.dtype) -> tuple:
    """A filled cache with shuffled block tables, and the step's query/metadata tensors."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = [cached + q_len for cached, q_len in specs]
    num_seq_blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    perm = torch.randperm(sum(num_seq_blocks), generator=gen)
    block_table = torch.zeros(len(specs), max(num_seq_blocks), dtype=torch.int32)
    slots, used = [], 0
    for i, (n, num_blocks) in enumerate(zip(seq_lens, num_seq_blocks, strict=True)):
        block_table[i, :num_blocks] = perm[used : used + num_blocks]
        used += num_blocks
        positions = torch.arange(n)
        slots.append(
            block_table[i, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        )
    shape = (2, len(perm), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.zeros(shape, dtype=dtype)
    key = torch.randn(sum(seq_lens), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    reshape_and_cache(key, key.flip(0), kv_cache, torch.cat(slots))
    q_lens = torch.tensor([q for _, q in specs], dtype=torch.int32)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()])
    query = torch.randn(int(q_lens.sum()), NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return query, kv_cache, AttentionMetadata.cached(block_table, seq_lens_t, query_start_loc)


def time_variants(names: list[str], args: tuple, repeats: int) -> list[tuple[float, float]]:
    """(median, min) ms per variant, the variants interleaved."""

    def variant(name: str):
        def call():
            reference.DECODE_GROUP_TOKENS, reference.PREFILL_GROUP_AREA = VARIANTS[name]
            kernel = cpu.paged_attention if name == "c++ decode" else paged_attention
            kernel(*args, HEAD_DIM**-0.5)

        return call

    samples = interleaved({name: variant(name) for name in names}, repeats)
    return [(statistics.median(samples[n]) * 1e3, min(samples[n]) * 1e3) for n in names]


def kernel_bandwidth(repeats: int) -> None:
    """The C++ decode kernel's achieved KV read rate against the machine's read bandwidth."""
    options = reference.AttentionOptions(HEAD_DIM**-0.5, None, None)
    peak = read_bandwidth_gb_s()
    print(f"read bandwidth (sum over 1 GiB): {peak:.1f} GB/s")
    for dtype in (torch.float32, torch.bfloat16):
        for label, specs in (
            ("64 x ctx 550", [(549, 1)] * 64),
            ("256 x ctx 100-2000", [(c, 1) for c, _ in mixes()["256 decode (ctx 100-2000)"]]),
            ("1 x ctx 2000", [(1999, 1)]),
        ):
            query, kv_cache, metadata = build(specs, dtype)
            kv_bytes = sum(c + 1 for c, _ in specs) * 2 * NUM_KV_HEADS * HEAD_DIM
            kv_bytes *= kv_cache.element_size()
            decode = functools.partial(
                cpu.paged_decode, query, kv_cache, metadata.block_table, metadata.seq_lens, options
            )
            median = statistics.median(interleaved({"decode": decode}, repeats)["decode"])
            rate = kv_bytes / median / 1e9
            print(
                f"{label:20s} {str(dtype)[6:]:9s} {kv_bytes / 2**20:7.1f} MiB  "
                f"{median * 1e3:6.2f} ms  {rate:5.1f} GB/s  ({rate / peak:.0%} of the read rate)"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--mallopt", action="store_true", help="tune glibc malloc first")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--bandwidth", action="store_true", help="the C++ kernel's GB/s against the machine's"
    )
    opts = parser.parse_args(argv)
    if opts.mallopt:
        tune_malloc()
    torch.set_num_threads(opts.threads)
    if opts.bandwidth:
        kernel_bandwidth(opts.repeats)
        return
    names = opts.variants.split(",")
    defaults = VARIANTS["grouped"]
    if not set(names) <= set(VARIANTS):
        parser.error(f"--variants must be among {', '.join(VARIANTS)}")
    print(
        f"torch {torch.__version__}, {opts.threads} threads, mallopt={opts.mallopt}, "
        f"median (min) of {opts.repeats} interleaved runs, ms per layer call"
    )
    print(f"{'batch':38s} {'dtype':9s}" + "".join(f"{n:>16s}" for n in names))
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for label, specs in mixes().items():
                args = build(specs, dtype)
                cells = time_variants(names, args, opts.repeats)
                row = "".join(f"{f'{med:.1f} ({low:.1f})':>16s}" for med, low in cells)
                print(f"{label:38s} {str(dtype).removeprefix('torch.'):9s}{row}")
    finally:
        reference.DECODE_GROUP_TOKENS, reference.PREFILL_GROUP_AREA = defaults


if __name__ == "__main__":
    main()
