"""Torch reference kernels for the paged KV cache; also the worker's CPU attention path.

``reshape_and_cache`` writes a step's new keys/values into their cache slots;
``paged_attention`` attends a flattened varlen batch over the paged cache (the signature of
every paged-attention kernel here: query, cache, AttentionMetadata, scale, optional sliding
window and soft cap); ``paged_attention_naive`` is the slow, obviously correct test oracle.

Sequences are sorted by (query length, context length) and cut into groups of similar
shape; each group gathers its keys and values through the block table into a padded buffer
and runs one masked SDPA. Decode rows never share a group with prefill ones, so they are
never padded to a prompt's length; grouped-query heads fold into the query rows, so no
key/value head is repeated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagestream_kernels import q8_0
from pagestream_kernels.attention_metadata import AttentionMetadata

# Padded key tokens (batch * longest context) per decode group: bounds padding waste and keeps
# the gathered buffers small (~6 MiB per fp32 key buffer at 3 kv heads x 64), which beats
# both one padded batch of all decode rows and a per-sequence loop.
DECODE_GROUP_TOKENS = 8192
# Padded query x key pairs per prefill group: short prompts are batched, long chunks run alone.
PREFILL_GROUP_AREA = 32768


@dataclass(frozen=True)
class _SeqGroup:
    """Sequences attended together, all tensors indexed by position in the group."""

    block_table: torch.Tensor  # [B, max_blocks_per_seq]
    seq_lens: torch.Tensor  # [B] int64
    q_starts: torch.Tensor  # [B] int64
    q_lens: torch.Tensor  # [B] int64, all >= 1
    max_query_len: int
    max_seq_len: int


@dataclass(frozen=True)
class AttentionOptions:
    scale: float
    sliding_window: int | None
    soft_cap: float | None


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` rows into their cache slots, in place.

    key, value:   [num_tokens, num_kv_heads, head_dim]
    kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V), contiguous;
                  uint8: q8_0 rows [.., num_kv_heads, q8_0.row_bytes(head_dim)], quantized here
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; negative = skip
    """
    num_kv_heads, row = kv_cache.shape[-2:]  # row: head_dim, or a q8_0 row's bytes
    # .view (not .reshape) so a non-contiguous cache fails loudly instead of writing to a copy.
    key_slots = kv_cache[0].view(-1, num_kv_heads, row)  # [num_slots, num_kv_heads, row]
    value_slots = kv_cache[1].view(-1, num_kv_heads, row)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0  # [num_tokens]
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    key_slots.index_copy_(0, slots, _cached(key, kv_cache.dtype))
    value_slots.index_copy_(0, slots, _cached(value, kv_cache.dtype))


def _cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows [tokens, kv_heads, head_dim] as the cache stores them (uint8: q8_0 rows)."""
    return q8_0.quantize(x) if cache_dtype == torch.uint8 else x.to(cache_dtype)


def _values(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows [..., row] as values [..., head_dim] of `dtype` (uint8: q8_0 rows)."""
    return q8_0.dequantize(cached, dtype) if cached.dtype == torch.uint8 else cached.to(dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged context (each row up
    to its key limit instead when the metadata has key_limits).

    query:    [num_tokens, num_q_heads, head_dim]
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], this step's K/V written
    metadata: the batch's block_table, seq_lens, query_start_loc (and key_limits)
    returns   [num_tokens, num_q_heads, head_dim] in query's dtype

    This path plans its groups on the host from the lengths (one small ``.tolist()``: free on
    CPU, a sync on CUDA; the metadata's max lengths are the Triton kernels' hints). The plan
    (groups, gather indices, masks) depends only on the step's metadata, so it is built once
    per step and reused by every layer (see ``_PlanCache``).
    """
    options = AttentionOptions(scale, sliding_window, soft_cap)
    return planned_attention(query, kv_cache, metadata, options)


# A kernel for groups of decode rows (one query token each), e.g. pagestream_kernels.cpu's:
# (query [B, q_heads, head_dim], kv_cache, block_table [B, max_blocks] int32,
#  seq_lens [B] int32, options) -> [B, q_heads, head_dim]
DecodeKernel = Callable[..., torch.Tensor]


def planned_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    options: AttentionOptions,
    decode_kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    """paged_attention over the step's cached plan; decode groups go to `decode_kernel`
    when one is given, every other group (and all of them without one) to masked SDPA."""
    if query.shape[1] % kv_cache.shape[3] != 0:
        raise ValueError(
            f"num_q_heads ({query.shape[1]}) must be a multiple of num_kv_heads "
            f"({kv_cache.shape[3]})."
        )
    out = torch.zeros_like(query)
    if metadata.seq_lens.numel() == 0 or query.shape[0] == 0:
        return out
    layout = (kv_cache.shape[2], query.shape[1] // kv_cache.shape[3], options.sliding_window)
    tables = (metadata.block_table, metadata.seq_lens, metadata.query_start_loc)
    for plan in _PLANS.get(*tables, metadata.key_limits, layout):
        if decode_kernel is not None and plan.max_query_len == 1:
            rows = query.index_select(0, plan.rows)  # [B, q_heads, head_dim]
            attended = decode_kernel(rows, kv_cache, plan.block_table, plan.seq_lens, options)
            out.index_copy_(0, plan.out_rows, attended)
        else:
            _attend_group(query, kv_cache, plan, options, out)
    return out


@dataclass(frozen=True)
class _GroupPlan:
    """Everything one group's attention needs that does not depend on the layer."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    slots: torch.Tensor  # [B*L] cache slot of every padded key position
    rows: torch.Tensor  # [B*Q] query row of every padded query position
    out_rows: torch.Tensor  # [n <= B*Q] the real rows among them, in order
    keep: torch.Tensor | None  # [B*Q] which padded rows are real (None: all, decode)
    mask: torch.Tensor  # [B, 1, Q*g or 1, L] attend-mask
    block_table: torch.Tensor  # [B, max_blocks_per_seq] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32


class _PlanCache:
    """The last step's plans, keyed by its metadata tensors and the layer layout.

    Every layer of a step gets the same block_table / seq_lens / query_start_loc (and
    key_limits) objects;
    a hit needs those very objects, unchanged contents (compared against copies, so an
    in-place edit replans), the same grouping budgets and the same (block_size,
    group_size, sliding_window). One entry: the next step's tensors replace it.
    """

    def __init__(self) -> None:
        self._entry: tuple | None = None

    def get(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        key_limits: torch.Tensor | None,
        layout: tuple[int, int, int | None],
    ) -> list[_GroupPlan]:
        tensors = (block_table, seq_lens, query_start_loc)
        if key_limits is not None:
            tensors += (key_limits,)
        budgets = (DECODE_GROUP_TOKENS, PREFILL_GROUP_AREA)
        entry = self._entry  # one read: another thread may replace it meanwhile
        if entry is not None and entry[3] == budgets and _same(entry[0], entry[1], tensors):
            plans = entry[2].get(layout)
            if plans is None:
                plans = entry[2][layout] = _build_plans(*tensors[:3], key_limits, *layout)
            return plans
        plans = _build_plans(*tensors[:3], key_limits, *layout)
        copies = tuple(t.clone() for t in tensors)
        self._entry = (tensors, copies, {layout: plans}, budgets)
        return plans


def _same(held: tuple, copies: tuple, tensors: tuple) -> bool:
    if len(held) != len(tensors):  # key_limits in one step and not the other
        return False
    return all(a is b for a, b in zip(held, tensors, strict=True)) and all(
        torch.equal(c, t) for c, t in zip(copies, tensors, strict=True)
    )


_PLANS = _PlanCache()


def _build_plans(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    key_limits: torch.Tensor | None,
    block_size: int,
    group_size: int,
    sliding_window: int | None,
) -> list[_GroupPlan]:
    plans = []
    for group in _plan_groups(block_table, seq_lens, query_start_loc):
        steps = torch.arange(group.max_query_len, device=group.q_starts.device)  # [Q]
        rows = group.q_starts[:, None] + steps  # [B, Q]
        row_valid = steps < group.q_lens[:, None]  # [B, Q]
        rows = torch.where(row_valid, rows, group.q_starts[:, None]).flatten()  # padding: real
        keep = None if group.max_query_len == 1 else row_valid.flatten()
        # [B, Q] each padded row's key limit (None: causal)
        limits = None if key_limits is None else key_limits[rows].long().view(row_valid.shape)
        plans.append(
            _GroupPlan(
                num_seqs=group.seq_lens.shape[0],
                max_query_len=group.max_query_len,
                max_seq_len=group.max_seq_len,
                slots=_gather_slots(group, block_size),
                rows=rows,
                out_rows=rows if keep is None else rows[keep],
                keep=keep,
                mask=_mask(group, sliding_window, group_size, limits),
                block_table=group.block_table.to(torch.int32).contiguous(),
                seq_lens=group.seq_lens.to(torch.int32),
            )
        )
    return plans


def _plan_groups(
    block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> list[_SeqGroup]:
    """Sort sequences by (query length, context length) and cut them into padded groups."""
    q_starts = query_start_loc[:-1].long()  # [num_seqs]
    q_lens = query_start_loc[1:].long() - q_starts  # [num_seqs]
    lens = seq_lens.long()  # [num_seqs]
    order = (q_lens * (1 << 32) + lens).argsort()  # [num_seqs]
    q_host, len_host = q_lens[order].tolist(), lens[order].tolist()
    groups, start = [], 0
    while start < len(q_host):
        if q_host[start] == 0:  # a sequence with nothing scheduled this step
            start += 1
            continue
        end = _group_end(q_host, len_host, start)
        ids = order[start:end].to(block_table.device)
        groups.append(
            _SeqGroup(
                block_table=block_table[ids],
                seq_lens=lens[ids],
                q_starts=q_starts[ids],
                q_lens=q_lens[ids],
                max_query_len=q_host[end - 1],
                max_seq_len=max(len_host[start:end]),
            )
        )
        start = end
    return groups


def _group_end(q_lens: list[int], seq_lens: list[int], start: int) -> int:
    """End of the group starting at ``start`` (inputs sorted by query then context length)."""
    is_decode = q_lens[start] == 1
    budget = DECODE_GROUP_TOKENS if is_decode else PREFILL_GROUP_AREA
    max_q, max_len, end = q_lens[start], seq_lens[start], start + 1
    while end < len(q_lens) and (q_lens[end] == 1) == is_decode:
        new_q, new_len = max(max_q, q_lens[end]), max(max_len, seq_lens[end])
        if (end + 1 - start) * new_q * new_len > budget:
            break
        max_q, max_len, end = new_q, new_len, end + 1
    return end


def _attend_group(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: _GroupPlan,
    options: AttentionOptions,
    out: torch.Tensor,
) -> None:
    """Attention for one group, written into its rows of ``out``."""
    num_kv_heads, row = kv_cache.shape[-2:]  # row: head_dim, or a q8_0 row's bytes
    num_seqs, num_q_heads, max_q = plan.num_seqs, query.shape[1], plan.max_query_len
    head_dim = query.shape[2]
    group_size = num_q_heads // num_kv_heads
    shape = (num_seqs, plan.max_seq_len, num_kv_heads, row)
    key = _values(_gather(kv_cache[0], plan.slots, shape), query.dtype)  # [B, kv_heads, L, hd]
    value = _values(_gather(kv_cache[1], plan.slots, shape), query.dtype)
    q = query.index_select(0, plan.rows)  # [B*Q, q_heads, head_dim]
    q = q.view(num_seqs, max_q, num_kv_heads, group_size, head_dim).transpose(1, 2)
    q = q.reshape(num_seqs, num_kv_heads, max_q * group_size, head_dim)  # rows ordered (Q, g)
    o = _attend(q, key, value, plan.mask, options)  # [B, kv_heads, Q*g, head_dim]
    o = o.view(num_seqs, num_kv_heads, max_q, group_size, head_dim).transpose(1, 2)
    o = o.reshape(num_seqs * max_q, num_q_heads, head_dim)  # [B*Q, q_heads, head_dim]
    out.index_copy_(0, plan.out_rows, o if plan.keep is None else o[plan.keep])


def _gather(cache: torch.Tensor, slots: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[num_blocks, block_size, kv_heads, head_dim] at ``slots`` -> [B, kv_heads, L, head_dim].

    One index_select along dim 0 per cache half (~4x faster than one along dim 1 of both).
    """
    flat = cache.view(-1, *cache.shape[-2:])  # [num_slots, kv_heads, head_dim]
    return flat.index_select(0, slots).view(shape).transpose(1, 2)


def _gather_slots(group: _SeqGroup, block_size: int) -> torch.Tensor:
    """[B*L] cache slots of the group's padded key positions.

    Positions past a sequence's length read its first slot (always written), never a slot that
    may hold garbage: a masked NaN would still poison the softmax-weighted sum.
    """
    positions = torch.arange(group.max_seq_len, device=group.block_table.device)  # [L]
    blocks = group.block_table[:, positions // block_size].long()  # [B, L]
    slots = blocks * block_size + positions % block_size  # [B, L]
    return torch.where(positions < group.seq_lens[:, None], slots, slots[:, :1]).flatten()


def _mask(
    group: _SeqGroup, sliding_window: int | None, group_size: int, limits: torch.Tensor | None
) -> torch.Tensor:
    """Boolean attend-mask [B, 1, Q*g, L] (or [B, 1, 1, L] for decode groups); `limits`
    [B, Q]: each row's key limit (None: causal, its position + 1)."""
    device = group.seq_lens.device
    steps = torch.arange(group.max_query_len, device=device)  # [Q]
    q_pos = (group.seq_lens - group.q_lens)[:, None] + steps  # [B, Q] absolute positions
    k_pos = torch.arange(group.max_seq_len, device=device)  # [L]
    if limits is None:
        limits = q_pos + 1
    mask = k_pos < limits[:, :, None]  # [B, Q, L]
    if sliding_window is not None:
        mask &= k_pos > q_pos[:, :, None] - sliding_window
    num_seqs, max_q, max_len = mask.shape
    if max_q == 1:
        return mask[:, None]  # [B, 1, 1, L], broadcast over the g folded rows
    mask = mask[:, None, :, None, :].expand(num_seqs, 1, max_q, group_size, max_len)
    return mask.reshape(num_seqs, 1, max_q * group_size, max_len)


def _attend(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    options: AttentionOptions,
) -> torch.Tensor:
    """Masked attention [B, H, R, D] x [B, H, L, D] -> [B, H, R, D]; float32 accumulation."""
    if options.soft_cap is None:
        return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=options.scale)
    scores = torch.matmul(q.float(), key.float().transpose(-1, -2)) * options.scale
    scores = options.soft_cap * torch.tanh(scores / options.soft_cap)  # [B, H, R, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), value.float()).to(q.dtype)


def paged_attention_naive(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Slow, obviously correct loop over sequences and query rows: the test oracle only."""
    block_table, seq_lens, key_limits = metadata.block_table, metadata.seq_lens, metadata.key_limits
    query_start_loc = metadata.query_start_loc
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group_size = query.shape[1] // num_kv_heads
    out = torch.zeros_like(query)
    for i in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[i])
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        for row in range(start, end):
            pos = seq_len - (end - start) + (row - start)  # absolute position of this token
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            limit = pos + 1 if key_limits is None else int(key_limits[row])
            positions = torch.arange(first, limit)  # [n] cache positions it attends to
            blocks = block_table[i, positions // block_size].long()
            keys = _values(kv_cache[0, blocks, positions % block_size], torch.float32)
            values = _values(kv_cache[1, blocks, positions % block_size], torch.float32)
            keys = keys.repeat_interleave(group_size, dim=1)  # [n, q_heads, hd]
            values = values.repeat_interleave(group_size, dim=1)
            scores = torch.einsum("hd,nhd->hn", query[row].float(), keys) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            probs = scores.softmax(dim=-1)  # [q_heads, n]
            out[row] = torch.einsum("hn,nhd->hd", probs, values).to(query.dtype)
    return out


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """The LoRA add of one linear slice, row by row (the ground truth of the grouped ones).

    y [T, N] float32 (updated in place and returned), x [T, K]: the linear's input;
    a [S, R, K], b [S, n, R] float32: the adapter slots' stacked A and scaled B (rank r of
    slot s uses a[s, :r] and b[s, :, :r]); token_slots [T] int32: each row's slot, -1 for
    none; slot_ranks [S] int32. Row t of slot s gets, in float64:
        y[t, offset:offset + n] += b[s, :, :r] @ (a[s, :r] @ x[t])
    """
    n = b.shape[1]
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        r = int(slot_ranks[slot])
        if r == 0:
            continue
        shrunk = a[slot, :r].double() @ x[t].double()  # [r]
        y[t, offset : offset + n] += (b[slot, :, :r].double() @ shrunk).to(y.dtype)
    return y
