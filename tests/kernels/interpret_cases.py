"""Triton kernels vs the torch references, through Triton's interpreter (CPU).

Not collected by a plain pytest run (the name does not match test_*.py): test_triton_interpret
runs this file in a subprocess with TRITON_INTERPRET=1 set before triton is imported, and
fails if it fails, skips or runs nothing. Run alone:

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/interpret_cases.py -q

Every cache block no sequence uses, every slot past a sequence's length and every block-table
entry past a sequence's blocks holds / points at NaN, so a stray read fails the comparison.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch

import pagestream_kernels.triton as triton_kernels
from pagestream import LLM, SamplingParams
from pagestream_kernels import reference
from pagestream_kernels.attention_metadata import AttentionMetadata
from pagestream_kernels.triton.fp8 import FP8_FORMATS, quantize_reference
from pagestream_kernels.triton.launch import run_paged_attention
from pagestream_kernels.triton.lora import add_lora_launches, lora_rows_per_program

if os.environ.get("TRITON_INTERPRET") != "1" or not triton_kernels.is_interpreted():
    raise RuntimeError("run with TRITON_INTERPRET=1 set before the process starts")

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3}


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int

    def args(self) -> tuple:
        metadata = AttentionMetadata(
            slot_mapping=torch.full((self.query.shape[0],), -1, dtype=torch.int64),
            block_table=self.block_table,
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
        )
        return self.query, self.kv_cache, metadata


def make_batch(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Batch:
    """seqs: (cached context length, query length) per sequence; the whole context is cached."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_blocks = sum(blocks_per_seq) + 4  # 4 blocks nobody uses: NaN
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(cache_shape, float("nan"), dtype=cache_dtype or dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    unused = order[sum(blocks_per_seq) :]
    block_table = torch.tensor(unused[:1], dtype=torch.int32).repeat(
        len(seqs), max(blocks_per_seq) + 2
    )  # entries past a sequence's blocks point at a NaN block
    slots, next_block = [], 0
    for i, ((ctx, q), count) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids = order[next_block : next_block + count]
        next_block += count
        block_table[i, :count] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(ctx + q)]
    shape = (len(slots), num_kv_heads, head_dim)
    key = torch.randn(shape, generator=gen).to(kv_cache.dtype)
    value = torch.randn(shape, generator=gen).to(kv_cache.dtype)
    reference.reshape_and_cache(key, value, kv_cache, torch.tensor(slots, dtype=torch.int64))
    q_lens = [q for _, q in seqs]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_kv_heads * group_size, head_dim, generator=gen).to(dtype)
    return Batch(
        query=query,
        kv_cache=kv_cache,
        block_table=block_table,
        seq_lens=torch.tensor([ctx + q for ctx, q in seqs], dtype=torch.int32),
        query_start_loc=query_start_loc,
        max_query_len=max(q_lens),
        max_seq_len=max(ctx + q for ctx, q in seqs),
    )


def check_attention(batch: Batch, split_kv=None, **options) -> None:
    scale = batch.query.shape[-1] ** -0.5
    got = run_paged_attention(*batch.args(), scale, split_kv=split_kv, **options)
    expected = reference.paged_attention_naive(*batch.args(), scale, **options)
    assert got.dtype == batch.query.dtype and got.shape == batch.query.shape
    assert not got.isnan().any()
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


# Prefill from scratch, chunked prefill over 1-3 cached blocks, decode rows.
MIXED = [(0, 7), (21, 5), (40, 1), (3, 1), (0, 1), (50, 2), (33, 1)]
DECODE = [(0, 1), (16, 1), (47, 1), (130, 1), (31, 1)]


@pytest.mark.parametrize(
    ("block_size", "group_size", "head_dim", "dtype"),
    [
        (16, 1, 64, torch.float32),
        (16, 4, 128, torch.float32),
        (32, 8, 64, torch.float32),
        (32, 1, 128, torch.float16),
        (16, 8, 128, torch.float16),
        (32, 4, 64, torch.float16),
    ],
)
def test_mixed_batch_matches_reference(block_size, group_size, head_dim, dtype):
    batch = make_batch(MIXED, block_size, 2, group_size, head_dim, dtype, seed=block_size)
    check_attention(batch)


@pytest.mark.parametrize("split_kv", [False, True])
@pytest.mark.parametrize(("group_size", "dtype"), [(4, torch.float32), (8, torch.float16)])
def test_decode_batch_split_and_unsplit(split_kv, group_size, dtype):
    batch = make_batch(DECODE, 16, 2, group_size, 64, dtype, seed=group_size)
    check_attention(batch, split_kv=split_kv)


@pytest.mark.parametrize(
    ("seqs", "split_kv", "options"),
    [
        (MIXED, None, {"sliding_window": 6}),
        (MIXED, None, {"soft_cap": 2.5}),
        (MIXED, None, {"sliding_window": 17, "soft_cap": 4.0}),
        (DECODE, True, {"sliding_window": 20, "soft_cap": 3.0}),
    ],
)
def test_sliding_window_and_soft_cap(seqs, split_kv, options):
    batch = make_batch(seqs, 16, 2, 4, 64, torch.float32, seed=3)
    check_attention(batch, split_kv=split_kv, **options)


def test_long_prefill_chunk_spans_several_query_blocks():
    # 150 query rows over 40 cached tokens: several query blocks per sequence and a group of 3;
    # the query is a strided view (the q part of a fused qkv projection).
    batch = make_batch([(40, 150), (0, 70)], 16, 1, 3, 32, torch.float32, seed=5)
    fused = torch.zeros(batch.query.shape[0], 5, 32)
    fused[:, :3] = batch.query
    batch.query = fused[:, :3]
    assert not batch.query.is_contiguous()
    check_attention(batch)


def test_mixed_cache_and_query_dtypes_and_idle_sequence():
    # fp16 cache, fp32 query (the reference casts K/V to the query dtype); a sequence with no
    # tokens this step produces no rows.
    seqs = [(10, 3), (25, 0), (30, 1)]
    batch = make_batch(seqs, 16, 2, 2, 64, torch.float32, cache_dtype=torch.float16, seed=7)
    check_attention(batch)


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "head_dim", "dtype"),
    [(16, 2, 64, torch.float32), (32, 3, 128, torch.float16), (16, 1, 80, torch.float32)],
)
def test_reshape_and_cache_matches_reference(block_size, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, num_tokens = 6, 19
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    cache = cache.to(dtype)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 11]] = -1  # padding rows: skipped
    # key/value as strided views of a fused projection, like the model's qkv split.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    reference.reshape_and_cache(key, value, expected, slots)
    triton_kernels.reshape_and_cache(key, value, cache, slots)
    torch.testing.assert_close(cache, expected, equal_nan=True, atol=0, rtol=0)
    assert cache.isnan().sum() == expected.isnan().sum() > 0


def test_engine_greedy_tokens_match_torch_backend(model_dir):
    folder = str(model_dir("llama"))
    prompts = [[5, 9, 31, 7, 100, 42, 8, 3, 77, 12, 61, 4, 19, 23, 200, 17, 90, 6], [5, 9, 31, 7]]
    prompts.append([*prompts[0][:16], 300, 301])  # a prefix-cache hit on one full block
    params = SamplingParams(temperature=0, max_tokens=5)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            folder,
            attention_backend=backend,
            kv_cache_memory="8MiB",
            max_num_batched_tokens=16,  # chunked prefill over cached context
            block_size=16,
        )
        assert llm.engine.worker.model.attention_ops.name == backend
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[backend] = [r.outputs[0].token_ids for r in results]
    assert all(len(tokens) == 5 for tokens in outputs["torch"])
    assert outputs["triton"] == outputs["torch"]


# LoRA: slots of rank R (two rank blocks of 16), 0, 5 and 17, one no row uses; K and n are
# not multiples of the block sizes (64); the slice starts at column 13 of a 110-column y.
LORA_RANKS = [24, 0, 5, 17, 24]
LORA_K, LORA_N, LORA_MAX_RANK, LORA_OFFSET, LORA_WIDTH = 70, 90, 24, 13, 110
# 37 rows in row blocks of 16: one slot, mixed slots with rows of no adapter, one slot (partial).
LORA_MIXED = [0] * 16 + [-1, 2, 3, 1, 0, -1, 3, 3, 2, -1, 0, 1, 2, 3, -1, 0] + [3] * 5
# 64 rows in row blocks of 16: no adapter, the rank-0 slot, one slot, mixed.
LORA_BLOCKS = [-1] * 16 + [1] * 16 + [2] * 16 + [3, -1, 0, 1] * 4


@dataclass
class LoraCase:
    y: torch.Tensor  # [T, N] float32
    x: torch.Tensor  # [T, K]
    a: torch.Tensor  # [S, R, K] float32
    b: torch.Tensor  # [S, n, R] float32
    token_slots: torch.Tensor  # [T] int32
    slot_ranks: torch.Tensor  # [S] int32
    offset: int

    def args(self, y: torch.Tensor) -> tuple:
        return y, self.x, self.a, self.b, self.token_slots, self.slot_ranks, self.offset


def make_lora_case(slots: list[int], x_dtype: torch.dtype, seed: int = 0) -> LoraCase:
    """A and B are NaN past each slot's rank, x is NaN on rows that add nothing (no slot or
    rank 0): a stray read fails the comparison."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, rank = len(LORA_RANKS), LORA_MAX_RANK
    a = torch.randn(num_slots, rank, LORA_K, generator=gen)
    b = torch.randn(num_slots, LORA_N, rank, generator=gen) * 0.1  # scale folded in
    for slot, r in enumerate(LORA_RANKS):
        a[slot, r:] = float("nan")
        b[slot, :, r:] = float("nan")
    x = torch.randn(len(slots), LORA_K, generator=gen)
    idle = torch.tensor([s < 0 or LORA_RANKS[s] == 0 for s in slots])
    x[idle] = float("nan")
    return LoraCase(
        y=torch.randn(len(slots), LORA_WIDTH, generator=gen),
        x=x.to(x_dtype),
        a=a,
        b=b,
        token_slots=torch.tensor(slots, dtype=torch.int32),
        slot_ranks=torch.tensor(LORA_RANKS, dtype=torch.int32),
        offset=LORA_OFFSET,
    )


def check_lora(case: LoraCase, got: torch.Tensor) -> None:
    """got within the float32 accumulation bound of the float64 reference; untouched bitwise.

    The kernels sum K float32 products (shrink), then r (expand), then add once into y; the
    reference rounds once. In any summation order m float32 terms lie within ~m*u of the
    exact sum relative to the sum of their magnitudes (u = 2**-24), so per element
    |got - expected| <= (K + R) u (|b| @ |a| @ |x|) + 2u |expected| (the adds into y), with
    a 2x margin for second-order terms. Rows that add nothing and columns outside the slice
    are bitwise unchanged.
    """
    expected = reference.add_lora(case.y.clone(), *case.args(case.y.clone())[1:])
    assert not got.isnan().any()
    chain = torch.zeros_like(got, dtype=torch.float64)
    columns = slice(case.offset, case.offset + LORA_N)
    for row, slot in enumerate(case.token_slots.tolist()):
        r = LORA_RANKS[slot] if slot >= 0 else 0
        if r:
            magnitude = case.a[slot, :r].double().abs() @ case.x[row].double().abs()
            chain[row, columns] = case.b[slot, :, :r].double().abs() @ magnitude
    u = 2.0**-24
    bound = 2 * ((LORA_K + LORA_MAX_RANK) * u * chain + 2 * u * expected.double().abs())
    error = (got.double() - expected.double()).abs()
    assert (error <= bound).all(), (error - bound).max()
    touched = chain > 0
    assert touched.any()
    assert torch.equal(got[~touched], case.y[~touched])


@pytest.mark.parametrize("rows_per_program", [1, 16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_add_lora_mixed_slots_match_reference(rows_per_program, x_dtype):
    case = make_lora_case(LORA_MIXED, x_dtype, seed=rows_per_program)
    y = case.y.clone()
    shrunk = torch.full((len(LORA_MIXED), LORA_MAX_RANK), float("nan"))  # unwritten: NaN
    launches = add_lora_launches(*case.args(y), shrunk=shrunk, rows_per_program=rows_per_program)
    assert [launch.constexprs["ROWS"] for launch in launches] == [rows_per_program] * 2
    for launch in launches:
        launch()
    check_lora(case, y)


def test_add_lora_row_blocks_of_no_adapter_rank_zero_one_slot_and_mixed():
    case = make_lora_case(LORA_BLOCKS, torch.float16, seed=3)
    y = case.y.clone()
    for launch in add_lora_launches(*case.args(y), rows_per_program=16):
        launch()
    check_lora(case, y)


@pytest.mark.parametrize(
    ("slot", "rows_per_program", "x_dtype"),
    [
        (0, 1, torch.float32),
        (0, 16, torch.bfloat16),
        (3, 1, torch.bfloat16),
        (2, 16, torch.float32),
    ],
)
def test_add_lora_one_row(slot, rows_per_program, x_dtype):
    case = make_lora_case([slot], x_dtype, seed=slot)
    y = case.y.clone()
    for launch in add_lora_launches(*case.args(y), rows_per_program=rows_per_program):
        launch()
    check_lora(case, y)


@pytest.mark.parametrize("slot", [-1, 1])  # no adapter, rank 0: y untouched
def test_add_lora_one_row_that_adds_nothing(slot):
    case = make_lora_case([slot], torch.float32)
    for rows_per_program in (1, 16):
        y = case.y.clone()
        for launch in add_lora_launches(*case.args(y), rows_per_program=rows_per_program):
            launch()
        assert torch.equal(y, case.y)


def test_add_lora_public_entry_point_strided_views():
    # x a column slice of a wider input, y a column slice of a wider output: strided rows.
    case = make_lora_case(LORA_MIXED, torch.bfloat16, seed=9)
    wide_x = torch.zeros(len(LORA_MIXED), LORA_K + 6, dtype=torch.bfloat16)
    wide_x[:, 3 : 3 + LORA_K] = case.x
    case.x = wide_x[:, 3 : 3 + LORA_K]
    wide_y = torch.zeros(len(LORA_MIXED), LORA_WIDTH + 5)
    y = wide_y[:, 5:]
    y.copy_(case.y)
    assert triton_kernels.add_lora(*case.args(y)) is y
    check_lora(case, y)
    assert not wide_y[:, :5].any()
    assert lora_rows_per_program(len(LORA_MIXED)) == 1 and lora_rows_per_program(4096) == 16


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"y": torch.zeros(37, 110, dtype=torch.float64)}, "float32"),
        ({"x": torch.zeros(37, 70, dtype=torch.int32)}, "bfloat16"),
        ({"x": torch.zeros(36, 70)}, "one row per row of y"),
        ({"x": torch.zeros(37, 71)}, "K=70"),
        ({"b": torch.zeros(5, 90, 23)}, r"\[S, n, R\]"),
        ({"slot_ranks": torch.zeros(4, dtype=torch.int32)}, r"\[S, n, R\]"),
        ({"token_slots": torch.zeros(37, dtype=torch.int64)}, "int32"),
        ({"offset": 21}, "do not fit"),
        ({"a": torch.zeros(5, 70, 24).transpose(1, 2)}, "contiguous"),
        ({"a": torch.zeros(24, 70)}, r"a \[S, R, K\]"),
    ],
)
def test_add_lora_rejects_bad_arguments(change, match):
    case = make_lora_case(LORA_MIXED, torch.float32)
    names = ("y", "x", "a", "b", "token_slots", "slot_ranks", "offset")
    args = dict(zip(names, case.args(case.y), strict=True))
    with pytest.raises(ValueError, match=match):
        triton_kernels.add_lora(**{**args, **change})


# ---------------------------------------------------------------- mixture of experts


def _moe_module(shared: int, tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False):
    from services.worker.layers.fused_moe import FusedMoE
    from tests.helpers.tiny_moe import HIDDEN, moe_spec, randomized

    moe = FusedMoE(moe_spec(shared), HIDDEN, tp_rank, tp_size, expert_parallel)
    return randomized(moe, seed=5), HIDDEN


@pytest.mark.parametrize("shared", [0, 40])
def test_fused_moe_kernels_equal_the_expert_loop(shared):
    """FusedMoE through the Triton kernels (its float weights stacked) equals its own loop
    over experts, with a shared expert and with 37 tokens (blocks of 16 slots padded)."""
    moe, hidden = _moe_module(shared)
    x = torch.randn(37, hidden, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = moe(x)
        assert moe.use_triton()
        got = moe(x)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_fused_moe_kernels_skip_the_experts_another_rank_holds(monkeypatch):
    """Expert parallelism: rank 1 of 2 holds experts 3..5; the others' slots are dropped
    (-1), as the loop skips them."""
    from services.worker.layers import fused_moe

    monkeypatch.setattr(fused_moe, "tp_all_reduce", lambda tensor: None)
    moe, hidden = _moe_module(0, tp_rank=1, tp_size=2, expert_parallel=True)
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = moe(x)
        assert moe.use_triton()
        assert moe.triton[0].shape[0] == 3  # only the local experts are stacked
        got = moe(x)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_fused_moe_kernel_in_half_precision():
    from pagestream_kernels.triton.fused_moe import fused_moe

    generator = torch.Generator().manual_seed(8)
    experts, hidden, inter, tokens, top_k = 5, 64, 48, 21, 2
    x = torch.randn(tokens, hidden, generator=generator).half()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.2).half()
    w2 = (torch.randn(experts, hidden, inter, generator=generator) * 0.2).half()
    picks = torch.randint(0, experts, (tokens, top_k), generator=generator)
    weights = torch.rand(tokens, top_k, generator=generator)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for j in range(top_k):
            e = int(picks[t, j])
            gate, up = (x[t].float() @ w13[e].float().T).chunk(2)
            act = (torch.nn.functional.silu(gate) * up).half().float()
            expected[t] += weights[t, j] * (act @ w2[e].float().T)
    got = fused_moe(x, w13, w2, weights, picks)
    torch.testing.assert_close(got, expected, atol=3e-3, rtol=3e-3)


# ---------------------------------------------------------------- fp8 KV cache
# The cache stores x * (1 / scale) rounded to nearest-even and saturated (triton/fp8.py); the
# interpreter decodes fp8 NaN as a finite value (480 for e4m3), so a stray read into an unused
# block still shows as a large wrong score or value rather than a NaN.

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def quantize_cache(cache: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float):
    """A float cache -> (the fp8 cache the kernels would hold, its dequantized float32 copy)."""
    quantized = torch.stack(
        [quantize_reference(cache[0], k_scale, dtype), quantize_reference(cache[1], v_scale, dtype)]
    )
    dequantized = torch.stack([quantized[0].float() * k_scale, quantized[1].float() * v_scale])
    return quantized, dequantized


def fp8_batch(seqs, group_size, dtype, fp8_dtype, k_scale=1.0, v_scale=1.0, seed=0):
    """A batch over an fp8 cache, and the same batch over its dequantized float32 cache."""
    batch = make_batch(seqs, 16, 2, group_size, 64, dtype, cache_dtype=torch.float32, seed=seed)
    batch.kv_cache = batch.kv_cache * torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    quantized, dequantized = quantize_cache(batch.kv_cache, fp8_dtype, k_scale, v_scale)
    return dataclasses.replace(batch, kv_cache=quantized), dataclasses.replace(
        batch, kv_cache=dequantized
    )


@pytest.mark.parametrize(
    ("fp8_dtype", "dtype", "k_scale", "v_scale"),
    [
        (torch.float8_e4m3fn, torch.float32, 1.0, 1.0),
        (torch.float8_e4m3fn, torch.bfloat16, 2.5, 0.75),
        (torch.float8_e5m2, torch.float16, 1.0, 1.0),
        (torch.float8_e5m2, torch.float32, 3.0, 1.0),
    ],
)
def test_reshape_and_cache_into_fp8_equals_torch_cast(fp8_dtype, dtype, k_scale, v_scale):
    """Bit-equal to torch's cast of x * (1 / scale), ties and subnormals included; values
    past the format's range (rows 0 and 5, x1e4 before the cast) saturate, never inf/NaN."""
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 5, 16, 2, 80, 23
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan")).to(fp8_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 17]] = -1  # padding rows: skipped
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen) * 4.0
    fused[:, :, :, :8] *= 1e-3  # fp8 subnormals
    fused[[0, 5]] *= 1e4 if dtype != torch.float16 else 1.0
    fused = fused.to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    triton_kernels.reshape_and_cache(key, value, cache, slots, k_scale=k_scale, v_scale=v_scale)

    expected = torch.full(shape, float("nan")).to(fp8_dtype)
    keep = slots >= 0
    for half, source, scale in ((0, key, k_scale), (1, value, v_scale)):
        rows = quantize_reference(source[keep], scale, fp8_dtype)
        expected[half].view(-1, num_kv_heads, head_dim).view(torch.uint8)[slots[keep]] = rows.view(
            torch.uint8
        )
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    written = cache[:, slots[keep] // block_size, slots[keep] % block_size].float()
    assert written.isfinite().all()
    if dtype != torch.float16:
        max_value = FP8_FORMATS[fp8_dtype].max_value
        assert written.abs().max() == max_value  # saturated, not inf / NaN


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize(
    ("seqs", "split_kv", "dtype", "k_scale", "v_scale"),
    [
        (MIXED, None, torch.float32, 1.0, 1.0),
        (MIXED, None, torch.float16, 0.5, 2.0),
        (DECODE, True, torch.float32, 2.0, 0.25),
        (DECODE, False, torch.float16, 1.0, 1.0),
    ],
)
def test_attention_over_fp8_cache_equals_reference_over_its_dequantized_cache(
    fp8_dtype, seqs, split_kv, dtype, k_scale, v_scale
):
    """Tight: the kernel upcasts fp8 exactly, so it differs from the float32 reference over
    stored * scale only by the query dtype's rounding (the float caches' tolerances)."""
    fp8, dequantized = fp8_batch(seqs, 4, dtype, fp8_dtype, k_scale, v_scale, seed=13)
    scale = 64**-0.5
    got = run_paged_attention(
        *fp8.args(), scale, split_kv=split_kv, k_scale=k_scale, v_scale=v_scale
    )
    expected = reference.paged_attention_naive(*dequantized.args(), scale)
    assert got.dtype == dtype and got.isfinite().all()
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def write_through_kernel(batch: Batch, cache_dtype: torch.dtype, scale: float = 1.0) -> Batch:
    """The batch's cached K/V (every slot it holds) written by the Triton kernel into a fresh
    NaN-filled cache of `cache_dtype` (k_scale = v_scale = `scale`)."""
    num_kv_heads, head_dim = batch.kv_cache.shape[3:]
    rows = batch.kv_cache.float().view(2, -1, num_kv_heads, head_dim)
    slots = (~rows[0].isnan().all(-1).all(-1)).nonzero().flatten()
    cache = torch.full(batch.kv_cache.shape, float("nan")).to(cache_dtype)
    scales = {"k_scale": scale, "v_scale": scale} if cache_dtype in FP8_FORMATS else {}
    triton_kernels.reshape_and_cache(rows[0, slots], rows[1, slots], cache, slots, **scales)
    return dataclasses.replace(batch, kv_cache=cache)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_attention_over_fp8_cache_near_a_bf16_cache(fp8_dtype):
    """Loose, by the format's precision u = 2**-(mantissa + 1) (e4m3 1/16, e5m2 1/8): each
    stored value is within u of itself, relatively; an output row is a softmax-weighted mean
    of value rows, and the keys' error moves the weights by a few percent. So the mean error
    is within u of the mean output magnitude (seen: ~0.45 u) and every element within
    2 u max|V| (seen: ~0.25 of that). The query is float32: the interpreter's bfloat16 dot
    is not trustworthy; what is compared is the cache's dtype."""
    base = make_batch(MIXED, 16, 2, 4, 64, torch.float32, cache_dtype=torch.float32, seed=17)
    bf16 = write_through_kernel(base, torch.bfloat16)
    fp8 = write_through_kernel(base, fp8_dtype)
    scale = 64**-0.5
    expected = run_paged_attention(*bf16.args(), scale)
    got = run_paged_attention(*fp8.args(), scale)
    u = 2.0 ** -(FP8_FORMATS[fp8_dtype].mantissa_bits + 1)
    error = (got - expected).abs()
    assert got.isfinite().all() and error.max() > 0  # fp8 did round something
    assert error.mean() <= u * expected.abs().mean(), (error.mean(), expected.abs().mean())
    max_value = bf16.kv_cache[1].float().nan_to_num(0.0).abs().max()
    assert error.max() <= 2 * u * max_value, (error.max(), max_value)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_cache_saturates_values_past_its_range(fp8_dtype):
    """Keys and values x1e5 (past 448 / 57344) are stored as +-max, never inf or NaN; the
    attention over them stays finite and equal to the reference over the saturated cache."""
    base = make_batch(DECODE, 16, 2, 2, 64, torch.float32, cache_dtype=torch.float32, seed=19)
    base.kv_cache[:, :, ::3] *= 1e5  # every third slot of every block
    fp8 = write_through_kernel(base, fp8_dtype, scale=2.0)
    used = ~base.kv_cache.isnan()
    stored = fp8.kv_cache.float()[used]
    max_value = FP8_FORMATS[fp8_dtype].max_value
    assert stored.isfinite().all() and stored.abs().max() == max_value
    scale = 64**-0.5
    got = run_paged_attention(*fp8.args(), scale, k_scale=2.0, v_scale=2.0)
    dequantized = dataclasses.replace(fp8, kv_cache=fp8.kv_cache.float() * 2.0)
    expected = reference.paged_attention_naive(*dequantized.args(), scale)
    assert got.isfinite().all()
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=2e-5)


@pytest.mark.parametrize(
    ("cache_dtype", "scales", "match"),
    [
        (torch.int8, {}, "float8_e4m3fn, float8_e5m2, not torch.int8"),
        (torch.float8_e4m3fnuz, {}, "not torch.float8_e4m3fnuz"),
        (torch.float8_e4m3fn, {"k_scale": 0.0}, "finite number > 0"),
        (torch.float8_e5m2, {"v_scale": float("nan")}, "finite number > 0"),
        (torch.float8_e5m2, {"v_scale": 1e-60}, "no float32 reciprocal"),
        (torch.bfloat16, {"k_scale": 2.0}, "fp8 KV cache only"),
    ],
)
def test_kernels_refuse_a_cache_dtype_or_scale_they_cannot_use(cache_dtype, scales, match):
    batch = make_batch(DECODE, 16, 2, 2, 64, torch.float32, seed=23)
    cache = torch.zeros(batch.kv_cache.shape, dtype=torch.uint8).view(cache_dtype)
    query, _, metadata = batch.args()
    rows = torch.zeros(3, 2, 64)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match=match):
        triton_kernels.reshape_and_cache(rows, rows, cache, slots, **scales)
    with pytest.raises(ValueError, match=match):
        triton_kernels.paged_attention(query, cache, metadata, 0.125, **scales)


def test_attention_layer_binds_its_kv_scales_to_the_triton_kernels():
    """A layer's (k_scale, v_scale) reach both kernels: the fp8 cache holds K / 2 and V / 0.5,
    and the output equals the reference over stored * scale; the torch kernels take none."""
    from services.worker.layers.attention import TORCH_ATTENTION, Attention, AttentionOps

    base = make_batch(MIXED, 16, 2, 2, 64, torch.float32, cache_dtype=torch.float32, seed=29)
    rows = base.kv_cache.view(2, -1, 2, 64)
    slots = (~rows[0].isnan().all(-1).all(-1)).nonzero().flatten()
    layer = Attention(4, 64, 64**-0.5, num_kv_heads=2)
    layer.ops = AttentionOps(
        "triton", triton_kernels.reshape_and_cache, triton_kernels.paged_attention, True
    )
    layer.kv_scales = (2.0, 0.5)
    cache = torch.full(base.kv_cache.shape, float("nan")).to(torch.float8_e4m3fn)
    key, value = rows[0, slots], rows[1, slots]
    layer.ops.with_kv_scales(*layer.kv_scales).reshape_and_cache(key, value, cache, slots)
    for half, source, scale in ((0, key, 2.0), (1, value, 0.5)):
        stored = cache[half].view(-1, 2, 64)[slots]
        expected_bits = quantize_reference(source, scale, torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(stored.view(torch.uint8), expected_bits)
    # Then the layer attends the batch's queries over that cache (its own step writes nothing:
    # every slot is -1).
    query, _, metadata = base.args()
    num_tokens = query.shape[0]
    empty = torch.zeros(num_tokens, 2 * 64)
    got = layer(query.reshape(num_tokens, -1), empty, empty, cache, metadata)
    dequantized = torch.stack([cache[0].float() * 2.0, cache[1].float() * 0.5])
    expected = reference.paged_attention_naive(query, dequantized, metadata, 64**-0.5)
    torch.testing.assert_close(got, expected.reshape(num_tokens, -1), atol=2e-5, rtol=2e-5)

    layer.ops = TORCH_ATTENTION
    with pytest.raises(ValueError, match="'torch' takes no KV cache scales"):
        layer(query.reshape(num_tokens, -1), empty, empty, cache, metadata)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_engine_with_an_fp8_kv_cache(model_dir, kv_cache_dtype):
    """--kv-cache-dtype fp8 / fp8_e5m2 on the Triton backend: the cache is allocated in fp8
    (a block half a float16 one's bytes) and greedy decoding starts as with a float16 cache:
    the same first token of every prompt, its logprob within 0.2 (the tiny random model's
    logits are nearly flat, so later tokens may part; seen: 0.05 e4m3, 0.11 e5m2)."""
    folder = str(model_dir("llama"))
    prompts = [[5, 9, 31, 7, 100, 42, 8, 3, 77, 12, 61, 4, 19, 23, 200, 17, 90, 6], [5, 9, 31, 7]]
    prompts.append([*prompts[0][:16], 300, 301])  # a prefix-cache hit on one full block
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=1)
    runs = {}
    for name in ("float16", kv_cache_dtype):
        llm = LLM(
            folder,
            attention_backend="triton",
            dtype="float32",
            kv_cache_dtype=name,
            kv_cache_memory="8MiB",
            max_num_batched_tokens=16,
            block_size=16,
        )
        worker = llm.engine.worker
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        firsts = [(r.outputs[0].token_ids[0], r.outputs[0].logprobs[0]) for r in results]
        spec = worker.kv_cache_spec
        runs[name] = (spec.dtype, spec.bytes_per_block(16), firsts)
    fp8_dtype = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    assert runs[kv_cache_dtype][0] == fp8_dtype and runs["float16"][0] == torch.float16
    assert 2 * runs[kv_cache_dtype][1] == runs["float16"][1]
    for (token, logprobs), (want, want_logprobs) in zip(
        runs[kv_cache_dtype][2], runs["float16"][2], strict=True
    ):
        assert token == want
        assert abs(logprobs[token].logprob - want_logprobs[want].logprob) <= 0.2
