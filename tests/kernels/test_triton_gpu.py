"""Triton kernels on a CUDA device, at Llama-3-8B sizes (32 query heads, 8 KV heads, head
dim 128, bf16): against the torch reference, the naive oracle (fp32) and an independent
``scaled_dot_product_attention`` over the contiguous keys/values each batch was built from.

Skipped (and says so) without CUDA; scripts/gpu_check.sh runs these, then benchmarks/kernels.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from pagestream_kernels import reference
from pagestream_kernels.attention_metadata import AttentionMetadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 2e-4}
# (cached context, query tokens): decode over 1-3k contexts, a 512-token prompt, chunked
# prefill over cached context, short prompts, decode at position 0.
MIXED = [(1000, 1), (0, 512), (2047, 1), (700, 256), (0, 3), (3000, 1), (64, 65), (0, 1)]
DECODE = [(4095, 1), (1023, 1), (17, 1), (2500, 1)]


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence [seq_len, KV_HEADS, HEAD_DIM], the ground truth
    values: list[torch.Tensor]
    seqs: list[tuple[int, int]]

    @property
    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata.cached(self.block_table, self.seq_lens, self.query_start_loc)

    def args(self) -> tuple:
        return self.query, self.kv_cache, self.metadata


def build(seqs, dtype=torch.bfloat16, block_size=16, first_block=0, seed=0) -> Batch:
    """NaN-filled cache; each sequence's K/V written through a shuffled block table."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = first_block + sum(counts) + 8
    shape = (2, num_blocks, block_size, KV_HEADS, HEAD_DIM)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    ids = first_block + torch.randperm(sum(counts), generator=gen, device="cuda")
    nan_block = num_blocks - 1
    block_table = torch.full((len(seqs), max(counts) + 4), nan_block, dtype=torch.int32)
    block_table = block_table.cuda()
    keys, values, used = [], [], 0
    for i, ((c, q), count) in enumerate(zip(seqs, counts, strict=True)):
        blocks = ids[used : used + count]
        used += count
        block_table[i, :count] = blocks.int()
        kv = torch.randn((2, c + q, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").to(dtype)
        positions = torch.arange(c + q, device="cuda")
        slots = blocks[positions // block_size] * block_size + positions % block_size
        reference.reshape_and_cache(kv[0], kv[1], kv_cache, slots)
        keys.append(kv[0])
        values.append(kv[1])
    q_lens = torch.tensor([q for _, q in seqs])
    starts = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    query = torch.randn((int(q_lens.sum()), Q_HEADS, HEAD_DIM), generator=gen, device="cuda")
    return Batch(
        query=query.to(dtype),
        kv_cache=kv_cache,
        block_table=block_table,
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32, device="cuda"),
        query_start_loc=starts.cuda(),
        keys=keys,
        values=values,
        seqs=seqs,
    )


def sdpa(batch: Batch, scale: float) -> torch.Tensor:
    """Per-sequence SDPA over the contiguous ground-truth K/V (bottom-right causal mask)."""
    out = torch.zeros_like(batch.query)
    start = 0
    for (context, q_len), key, value in zip(batch.seqs, batch.keys, batch.values, strict=True):
        q = batch.query[start : start + q_len].transpose(0, 1)  # [Q_HEADS, q_len, D]
        k = key.transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, 0)  # [Q_HEADS, L, D]
        v = value.transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, 0)
        rows = context + torch.arange(q_len, device="cuda")[:, None]
        mask = torch.arange(context + q_len, device="cuda")[None, :] <= rows
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def triton_attention(batch: Batch, split_kv=None, **options) -> torch.Tensor:
    from pagestream_kernels.triton.launch import run_paged_attention

    scale = HEAD_DIM**-0.5
    out = run_paged_attention(*batch.args(), scale, split_kv=split_kv, **options)
    torch.cuda.synchronize()
    return out


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert not got.isnan().any()
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference_and_sdpa_bf16(block_size):
    batch = build(MIXED, block_size=block_size)
    got = triton_attention(batch)
    scale = HEAD_DIM**-0.5
    assert_close(got, reference.paged_attention(*batch.args(), scale))
    assert_close(got, sdpa(batch, scale))


@pytest.mark.parametrize("split_kv", [None, False, True])
def test_decode_matches_sdpa_split_or_not(split_kv):
    batch = build(DECODE, seed=1)
    assert_close(triton_attention(batch, split_kv=split_kv), sdpa(batch, HEAD_DIM**-0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_match_the_naive_oracle(dtype):
    batch = build([(40, 1), (0, 37), (100, 20), (300, 1)], dtype=dtype, seed=2)
    expected = reference.paged_attention_naive(*batch.args(), HEAD_DIM**-0.5)
    assert_close(triton_attention(batch), expected)


@pytest.mark.parametrize(
    "options",
    [{"sliding_window": 256}, {"soft_cap": 30.0}, {"sliding_window": 100, "soft_cap": 5.0}],
)
def test_sliding_window_and_soft_cap_match_reference(options):
    batch = build(MIXED[:4], dtype=torch.float32, seed=3)
    expected = reference.paged_attention(*batch.args(), HEAD_DIM**-0.5, **options)
    assert_close(triton_attention(batch, **options), expected)
    decode = build(DECODE, dtype=torch.float32, seed=4)
    expected = reference.paged_attention(*decode.args(), HEAD_DIM**-0.5, **options)
    assert_close(triton_attention(decode, split_kv=True, **options), expected)


def test_offsets_past_two_to_the_31_elements():
    # The sequence's blocks sit above element 2**31 of the K half of the cache (bf16: 4 GiB).
    per_block = 16 * KV_HEADS * HEAD_DIM
    batch = build([(200, 1), (0, 40)], first_block=(1 << 31) // per_block + 1, seed=5)
    assert batch.kv_cache[0].numel() > (1 << 31)
    assert_close(triton_attention(batch), sdpa(batch, HEAD_DIM**-0.5))


def test_reshape_and_cache_equals_reference_bitwise():
    from pagestream_kernels.triton import reshape_and_cache

    gen = torch.Generator(device="cuda").manual_seed(6)
    cache = torch.randn((2, 64, 16, KV_HEADS, HEAD_DIM), generator=gen, device="cuda")
    cache = cache.bfloat16()
    expected = cache.clone()
    fused = torch.randn((300, 3, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").bfloat16()
    slots = torch.randperm(64 * 16, generator=gen, device="cuda")[:300]
    slots[::7] = -1
    reference.reshape_and_cache(fused[:, 1], fused[:, 2], expected, slots)
    reshape_and_cache(fused[:, 1], fused[:, 2], cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


def test_auto_backend_is_triton_on_cuda_and_the_engine_matches_torch(tmp_path):
    from services.worker.layers.attention import resolve_attention_backend
    from tests.helpers.tiny_models import build_tiny_model

    assert resolve_attention_backend("auto", torch.device("cuda")).name == "triton"
    from pagestream import LLM, SamplingParams

    folder = tmp_path / "llama"
    build_tiny_model("llama").save_pretrained(folder)
    prompts = [{"prompt_token_ids": [5 + i, 9, 31, 7, 100, 42, 8, 3] * (i + 1)} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(folder),
            attention_backend=backend,
            device="cuda",
            dtype="float32",
            kv_cache_memory="64MiB",
            max_num_batched_tokens=32,
        )
        assert llm.engine.worker.model.attention_ops.name == backend
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("rows_per_program", [None, 1])  # None: the heuristic's 16 here
def test_add_lora_matches_reference_at_llama_sizes(rows_per_program):
    # The v slice of Llama-3-8B's fused qkv (K 4096 -> n 1024 at column 5120 of 6144), bf16
    # input, ranks 64 (= R), 8, 0 and 16: a 600-row prefill chunk of one adapter, then 200
    # decode rows of mixed adapters and none.
    from pagestream_kernels.triton.lora import add_lora_launches

    gen = torch.Generator(device="cuda").manual_seed(7)
    num_tokens, k, n, max_rank, offset, width = 800, 4096, 1024, 64, 5120, 6144
    ranks = torch.tensor([64, 8, 0, 16], dtype=torch.int32, device="cuda")
    a = torch.randn((4, max_rank, k), generator=gen, device="cuda") * k**-0.5
    b = torch.randn((4, n, max_rank), generator=gen, device="cuda") * 0.1
    slots = torch.randint(-1, 4, (num_tokens,), generator=gen, device="cuda").int()
    slots[:600] = 1
    x = torch.randn((num_tokens, k), generator=gen, device="cuda").bfloat16()
    y = torch.randn((num_tokens, width), generator=gen, device="cuda")
    expected = reference.add_lora(y.clone(), x, a, b, slots, ranks, offset)
    launches = add_lora_launches(
        y, x, a, b, slots, ranks, offset, rows_per_program=rows_per_program
    )
    assert launches[0].constexprs["ROWS"] == (rows_per_program or 16)
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    # float32 accumulation over K + R terms, then one add into y (see interpret_cases.py).
    chain = torch.zeros_like(y, dtype=torch.float64)
    for slot, r in enumerate(ranks.tolist()):
        rows = slots == slot
        magnitude = x[rows].double().abs() @ a[slot, :r].double().abs().T
        chain[rows, offset : offset + n] = magnitude @ b[slot, :, :r].double().abs().T
    u = 2.0**-24
    bound = 2 * ((k + max_rank) * u * chain + 2 * u * expected.double().abs())
    assert ((y.double() - expected.double()).abs() <= bound).all()
    untouched = chain == 0
    assert torch.equal(y[untouched], expected[untouched])


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_writes_equal_torch_cast_and_attention_its_dequantized_reference(fp8_dtype):
    """On the GPU's own fp8 conversions: writes bit-equal to torch's saturated cast of
    x * (1 / scale) (rows x1e5 saturate); attention (bf16 queries, split decode included)
    within bf16 tolerance of the naive reference over stored * scale."""
    from pagestream_kernels.triton import reshape_and_cache
    from pagestream_kernels.triton.fp8 import quantize_reference

    k_scale, v_scale = 2.5, 0.75
    batch = build(MIXED[:4] + DECODE[:2], seed=8)
    gen = torch.Generator(device="cuda").manual_seed(8)
    fused = torch.randn((300, 3, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").bfloat16()
    fused[::11] *= 1e5
    slots = torch.randperm(64 * 16, generator=gen, device="cuda")[:300]
    cache = torch.zeros((2, 64, 16, KV_HEADS, HEAD_DIM), device="cuda").to(fp8_dtype)
    reshape_and_cache(fused[:, 1], fused[:, 2], cache, slots, k_scale=k_scale, v_scale=v_scale)
    torch.cuda.synchronize()
    for half, source, scale in ((0, fused[:, 1], k_scale), (1, fused[:, 2], v_scale)):
        stored = cache[half].view(-1, KV_HEADS, HEAD_DIM)[slots].view(torch.uint8)
        assert torch.equal(stored, quantize_reference(source, scale, fp8_dtype).view(torch.uint8))

    fp8 = torch.stack(
        [
            quantize_reference(batch.kv_cache[0], k_scale, fp8_dtype),
            quantize_reference(batch.kv_cache[1], v_scale, fp8_dtype),
        ]
    )
    dequantized = torch.stack([fp8[0].float() * k_scale, fp8[1].float() * v_scale])
    query, _, metadata = batch.args()
    expected = reference.paged_attention_naive(query, dequantized, metadata, HEAD_DIM**-0.5)
    for split_kv in (None, False):
        got = triton_attention(
            Batch(**{**batch.__dict__, "kv_cache": fp8}),
            split_kv=split_kv,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        assert_close(got, expected)
    decode = build(DECODE, seed=9)
    fp8_decode = torch.stack(
        [quantize_reference(decode.kv_cache[i], 1.0, fp8_dtype) for i in (0, 1)]
    )
    expected = reference.paged_attention_naive(
        decode.query, fp8_decode.float(), decode.metadata, HEAD_DIM**-0.5
    )
    got = triton_attention(Batch(**{**decode.__dict__, "kv_cache": fp8_decode}), split_kv=True)
    assert_close(got, expected)
