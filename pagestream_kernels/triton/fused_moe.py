"""A mixture of experts' two GEMMs in Triton: each expert's rows of a step, one launch each.

    out = fused_moe(x, w13, w2, weights, experts)  # [T, H]

The token slots (slot s = token s // k's (s % k)-th pick) are sorted by expert and padded
to blocks of one expert (`align_by_expert`), so each expert's weight is read once per block
of its rows. float32 inputs multiply in IEEE float32 (the torch reference's precision),
others in their own type with float32 accumulation. Shapes: `fused_moe`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # slots per program (the minimum tl.dot dimension)
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _moe_gemm(
    a_ptr,
    w_ptr,
    c_ptr,
    slots_ptr,  # [blocks * BLOCK_M] int64: the slots sorted by expert, num_slots = padding
    block_expert_ptr,  # [blocks] int64: each block's expert (-1: a block past the last)
    weight_ptr,  # [num_slots] float32 (read only with MUL_WEIGHT)
    N,
    K,
    num_slots,
    a_row_div,  # a's row of slot s: s // a_row_div (k for x, 1 for act)
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[s, n tile] = a[s // a_row_div] @ w[expert, n tile].T (* weight[s]) for the slots of
    block program_id(0)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + offs_m)
    valid = slots < num_slots
    rows = (slots // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + tl.arange(0, BLOCK_K)
        k_valid = k < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + k[None, :],
            mask=valid[:, None] & k_valid[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_cols + k[:, None], mask=k_valid[:, None] & n_valid[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if MUL_WEIGHT:
        scale = tl.load(weight_ptr + slots, mask=valid, other=0.0)
        acc = acc * scale[:, None]
    out = c_ptr + slots[:, None].to(tl.int64) * stride_c + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_valid[None, :])


def align_by_expert(
    experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] (-1: dropped) -> (slots [blocks * block_m] int64 sorted by expert,
    each expert's run padded with T * k to a multiple of block_m; the expert of each
    block [blocks] int64)."""
    flat = experts.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    kept = flat >= 0
    keyed = torch.where(kept, flat, num_experts)  # dropped slots sort last
    order = torch.argsort(keyed, stable=True)
    counts = torch.bincount(keyed, minlength=num_experts + 1)[:num_experts]
    blocks = (counts + block_m - 1) // block_m  # [E]
    padded_start = torch.cumsum(blocks * block_m, 0) - blocks * block_m  # [E]
    start = torch.cumsum(counts, 0) - counts  # [E]: each expert's first sorted position
    total = int(blocks.sum())
    slots = torch.full((total * block_m,), num_slots, dtype=torch.int64, device=flat.device)
    sorted_experts = keyed[order]
    real = sorted_experts < num_experts
    position = torch.arange(num_slots, device=flat.device)
    e = sorted_experts[real]
    slots[padded_start[e] + position[real] - start[e]] = order[real]
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), blocks)
    return slots, block_expert


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    block_expert: torch.Tensor,
    a_row_div: int,
    weights: torch.Tensor | None,
) -> None:
    """One launch of _moe_gemm: out [num_slots, N] rows of the slots in `slots`."""
    n, k = w.shape[1], w.shape[2]
    if block_expert.numel() == 0:
        return
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    _moe_gemm[grid](
        a,
        w,
        out,
        slots,
        block_expert,
        weights if weights is not None else out,
        n,
        k,
        out.shape[0],
        a_row_div,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """The mixture of x [T, H] -> [T, H] float32.

    x [T, H]; w13 [E, 2I, H] (every expert's gate rows, then its up rows); w2 [E, H, I];
    weights / experts [T, k] (the router's top k: float32 weights, expert ids, -1 for an
    expert this rank does not hold). A program multiplies one block's rows by one column
    tile of its expert's weight:

        _moe_gemm(x, w13):  inter[s] = x[s // k] @ w13[e].T        [T * k, 2I]  (float32)
        silu(gate) * up:    act[s]                                 [T * k, I]   (torch)
        _moe_gemm(act, w2): y[s] = weights[s] * act[s] @ w2[e].T   [T * k, H]
        out[t] = sum_j y[t * k + j]
    """
    tokens, top_k = experts.shape
    inter = w2.shape[2]
    slots, block_expert = align_by_expert(experts, w13.shape[0])
    x = x.contiguous()
    gate_up = torch.zeros(tokens * top_k, 2 * inter, dtype=torch.float32, device=x.device)
    _gemm(x, w13.contiguous(), gate_up, slots, block_expert, top_k, None)
    gate, up = gate_up.split(inter, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).to(x.dtype).contiguous()  # [T * k, I]
    y = torch.zeros(tokens * top_k, w2.shape[1], dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _gemm(act, w2.contiguous(), y, slots, block_expert, 1, flat_weights)
    return y.view(tokens, top_k, -1).sum(dim=1)
