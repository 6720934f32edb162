"""Paged-attention batches whose ground truth is known: contiguous per-sequence keys/values
written into a NaN-filled cache through shuffled, non-contiguous block tables whose padding
points at NaN blocks (so any stray read poisons the result), and the SDPA reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagestream_kernels import reshape_and_cache
from pagestream_kernels.attention_metadata import AttentionMetadata

# (cached context tokens, query tokens) per sequence: decode rows, a whole prompt, chunked
# prefills on top of cached context, a short prompt, a sequence with nothing scheduled.
MIXED = [(37, 1), (0, 23), (5, 1), (40, 19), (70, 1), (0, 2), (16, 1), (12, 0), (33, 16), (1, 1)]


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    specs: list[tuple[int, int]]

    @property
    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata.cached(self.block_table, self.seq_lens, self.query_start_loc)

    def args(self) -> tuple:
        return self.query, self.kv_cache, self.metadata


def build_batch(
    specs: list[tuple[int, int]],
    *,
    block_size: int = 16,
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [cached + q_len for cached, q_len in specs]
    num_seq_blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(num_seq_blocks) + 3  # a few blocks nobody owns: they stay NaN
    perm = torch.randperm(num_blocks, generator=gen)
    nan_block = int(perm[-1])
    block_table = torch.full((len(specs), max(num_seq_blocks) + 2), nan_block, dtype=torch.int32)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values, slots, new_keys, new_values = [], [], [], [], []
    used = 0
    for i, ((cached, _), seq_len) in enumerate(zip(specs, seq_lens, strict=True)):
        blocks = perm[used : used + num_seq_blocks[i]]
        used += num_seq_blocks[i]
        block_table[i, : len(blocks)] = blocks
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        positions = torch.arange(seq_len)
        seq_slots = blocks[positions // block_size] * block_size + positions % block_size
        # Earlier context straight into the cache; this step's tokens via reshape_and_cache.
        kv_cache[0].view(-1, num_kv_heads, head_dim)[seq_slots[:cached]] = k[:cached]
        kv_cache[1].view(-1, num_kv_heads, head_dim)[seq_slots[:cached]] = v[:cached]
        slots.append(seq_slots[cached:])
        new_keys.append(k[cached:])
        new_values.append(v[cached:])
    reshape_and_cache(torch.cat(new_keys), torch.cat(new_values), kv_cache, torch.cat(slots))
    q_lens = torch.tensor([q_len for _, q_len in specs])
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    query = torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim, generator=gen)
    return Batch(
        query=query.to(dtype),
        kv_cache=kv_cache,
        block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        keys=keys,
        values=values,
        specs=specs,
    )


def reference_attention(
    batch: Batch,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Per sequence, on the contiguous ground-truth K/V: offset causal mask + SDPA (float32)."""
    outs = []
    group = batch.query.shape[1] // batch.keys[0].shape[1]
    start = 0
    for (cached, q_len), k, v in zip(batch.specs, batch.keys, batch.values, strict=True):
        q = batch.query[start : start + q_len].float().transpose(0, 1)  # [q_heads, q_len, hd]
        start += q_len
        k = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [q_heads, L, hd]
        v = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        q_pos = cached + torch.arange(q_len)[:, None]  # [q_len, 1]
        k_pos = torch.arange(k.shape[1])[None, :]  # [1, L]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        if soft_cap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            scores = soft_cap * torch.tanh(q @ k.transpose(1, 2) * scale / soft_cap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        outs.append(o.transpose(0, 1))  # [q_len, q_heads, hd]
    return torch.cat(outs)
