"""Grouped LoRA of one linear slice in two Triton kernels (BGMV / SGMV style): shrink, expand.

Every row of the step reads its own adapter slot (``token_slots[row]``, -1 for none), so one
shrink and one expand launch serve all rows and all adapters of a step. With
``r = min(slot_ranks[slot], R)``:

    lora_shrink:  shrunk[row, :r] = a[slot, :r] @ x[row]                      (float32)
    lora_expand:  y[row, offset:offset + n] += b[slot, :, :r] @ shrunk[row, :r]

The grids and the rows per program: add_lora_launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagestream_kernels.triton.launch import KernelLaunch

SHRINK_BLOCK_R = 16  # ranks per shrink program (the minimum tl.dot dimension)
SHRINK_BLOCK_K = 64  # input features per shrink loop step
EXPAND_BLOCK_N = 64  # output columns per expand program
EXPAND_BLOCK_R = 16  # ranks per expand loop step
# Steps of at least ROW_BLOCK_MIN_TOKENS rows (prefill-sized) take ROW_BLOCK rows per program.
ROW_BLOCK = 16
ROW_BLOCK_MIN_TOKENS = 512
NUM_WARPS = 4
NUM_STAGES = 2
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _shrink_row(
    shrunk_ptr,
    x_ptr,
    a_ptr,
    row,
    slot,
    rank,
    offs_r,  # [BLOCK_R] ranks of this program
    K,
    stride_x_row,
    stride_a_slot,
    stride_a_rank,
    stride_shrunk_row,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """shrunk[row, offs_r] = a[slot, offs_r] @ x[row] for the ranks below `rank`."""
    rank_valid = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + slot * stride_a_slot + offs_r[:, None] * stride_a_rank  # [BLOCK_R, 1]
    x_row = x_ptr + row * stride_x_row
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + offs_k
        k_valid = k < K
        x = tl.load(x_row + k, mask=k_valid, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(
            a_rows + k[None, :], mask=rank_valid[:, None] & k_valid[None, :], other=0.0
        )  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(shrunk_ptr + row * stride_shrunk_row + offs_r, acc, mask=rank_valid)


@triton.jit
def _shrink_block(
    shrunk_ptr,
    x_ptr,
    a_ptr,
    rows,  # [ROWS] rows of this program, all of slot `slot`
    row_valid,  # [ROWS]
    slot,
    rank,
    offs_r,  # [BLOCK_R]
    K,
    stride_x_row,
    stride_a_slot,
    stride_a_rank,
    stride_shrunk_row,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """shrunk[rows, offs_r] = x[rows] @ a[slot, offs_r].T for the ranks below `rank`."""
    rank_valid = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x_row  # [ROWS, 1]
    a_cols = a_ptr + slot * stride_a_slot + offs_r[None, :] * stride_a_rank  # [1, BLOCK_R]
    acc = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + offs_k
        k_valid = k < K
        x = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0).to(
            tl.float32
        )  # [ROWS, BLOCK_K]
        a = tl.load(
            a_cols + k[:, None], mask=k_valid[:, None] & rank_valid[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_R]
        acc = tl.dot(x, a, acc, input_precision="ieee")
    shrunk = shrunk_ptr + rows[:, None].to(tl.int64) * stride_shrunk_row + offs_r[None, :]
    tl.store(shrunk, acc, mask=row_valid[:, None] & rank_valid[None, :])


@triton.jit
def lora_shrink_kernel(
    shrunk_ptr,  # [T, R] float32
    x_ptr,  # [T, K] float32 / bfloat16 / float16
    a_ptr,  # [S, R, K] float32
    token_slots_ptr,  # [T] int32, -1: no adapter
    slot_ranks_ptr,  # [S] int32
    num_tokens,
    K,
    max_rank,  # R
    stride_x_row: tl.int64,
    stride_a_slot: tl.int64,
    stride_a_rank: tl.int64,
    stride_shrunk_row: tl.int64,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """shrunk[row, :r] = a[slot, :r] @ x[row] for every row with a slot; grid (row programs,
    rank blocks). Rows without a slot, and ranks at or past their slot's, write nothing."""
    program = tl.program_id(0)
    rank_block = tl.program_id(1)
    offs_r = rank_block * BLOCK_R + tl.arange(0, BLOCK_R)
    if ROWS == 1:
        row = program.to(tl.int64)
        slot = tl.load(token_slots_ptr + row)
        if slot < 0:
            return
        rank = tl.minimum(tl.load(slot_ranks_ptr + slot), max_rank)
        if rank_block * BLOCK_R >= rank:
            return
        _shrink_row(
            shrunk_ptr,
            x_ptr,
            a_ptr,
            row,
            slot,
            rank,
            offs_r,
            K,
            stride_x_row,
            stride_a_slot,
            stride_a_rank,
            stride_shrunk_row,
            BLOCK_R,
            BLOCK_K,
        )
    else:
        rows = program * ROWS + tl.arange(0, ROWS)
        row_valid = rows < num_tokens
        slots = tl.load(token_slots_ptr + rows, mask=row_valid, other=-1)
        last = tl.max(slots, 0)
        if last < 0:
            return
        first = tl.min(tl.where(row_valid, slots, last), 0)
        if first == last:  # one slot for the whole block: tl.dot over the block
            rank = tl.minimum(tl.load(slot_ranks_ptr + last), max_rank)
            if rank_block * BLOCK_R < rank:
                _shrink_block(
                    shrunk_ptr,
                    x_ptr,
                    a_ptr,
                    rows,
                    row_valid,
                    last,
                    rank,
                    offs_r,
                    K,
                    stride_x_row,
                    stride_a_slot,
                    stride_a_rank,
                    stride_shrunk_row,
                    ROWS,
                    BLOCK_R,
                    BLOCK_K,
                )
        else:  # mixed slots: row by row
            for i in range(ROWS):
                row = (program * ROWS + i).to(tl.int64)
                slot = tl.load(token_slots_ptr + row, mask=row < num_tokens, other=-1)
                if slot >= 0:
                    rank = tl.minimum(tl.load(slot_ranks_ptr + slot), max_rank)
                    if rank_block * BLOCK_R < rank:
                        _shrink_row(
                            shrunk_ptr,
                            x_ptr,
                            a_ptr,
                            row,
                            slot,
                            rank,
                            offs_r,
                            K,
                            stride_x_row,
                            stride_a_slot,
                            stride_a_rank,
                            stride_shrunk_row,
                            BLOCK_R,
                            BLOCK_K,
                        )


@triton.jit
def _expand_row(
    y_ptr,
    shrunk_ptr,
    b_ptr,
    row,
    slot,
    rank,
    offs_n,  # [BLOCK_N] columns of the slice
    n,
    offset,
    stride_y_row,
    stride_b_slot,
    stride_b_col,
    stride_shrunk_row,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[row, offset + offs_n] += b[slot, offs_n, :rank] @ shrunk[row, :rank]."""
    col_valid = offs_n < n
    offs_r = tl.arange(0, BLOCK_R)
    b_rows = b_ptr + slot * stride_b_slot + offs_n[:, None] * stride_b_col  # [BLOCK_N, 1]
    shrunk_row = shrunk_ptr + row * stride_shrunk_row
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r_start in range(0, rank, BLOCK_R):
        r = r_start + offs_r
        rank_valid = r < rank
        shrunk = tl.load(shrunk_row + r, mask=rank_valid, other=0.0)  # [BLOCK_R]
        b = tl.load(
            b_rows + r[None, :], mask=col_valid[:, None] & rank_valid[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_R]
        acc += tl.sum(b * shrunk[None, :], axis=1)
    y = y_ptr + row * stride_y_row + offset + offs_n
    tl.store(y, tl.load(y, mask=col_valid) + acc, mask=col_valid)


@triton.jit
def _expand_block(
    y_ptr,
    shrunk_ptr,
    b_ptr,
    rows,  # [ROWS] rows of this program, all of slot `slot`
    row_valid,  # [ROWS]
    slot,
    rank,
    offs_n,  # [BLOCK_N]
    n,
    offset,
    stride_y_row,
    stride_b_slot,
    stride_b_col,
    stride_shrunk_row,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[rows, offset + offs_n] += shrunk[rows, :rank] @ b[slot, offs_n, :rank].T."""
    col_valid = offs_n < n
    offs_r = tl.arange(0, BLOCK_R)
    rows64 = rows[:, None].to(tl.int64)  # [ROWS, 1]
    b_cols = b_ptr + slot * stride_b_slot + offs_n[None, :] * stride_b_col  # [1, BLOCK_N]
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for r_start in range(0, rank, BLOCK_R):
        r = r_start + offs_r
        rank_valid = r < rank
        shrunk = tl.load(
            shrunk_ptr + rows64 * stride_shrunk_row + r[None, :],
            mask=row_valid[:, None] & rank_valid[None, :],
            other=0.0,
        )  # [ROWS, BLOCK_R]
        b = tl.load(
            b_cols + r[:, None], mask=rank_valid[:, None] & col_valid[None, :], other=0.0
        )  # [BLOCK_R, BLOCK_N]
        acc = tl.dot(shrunk, b, acc, input_precision="ieee")
    y = y_ptr + rows64 * stride_y_row + offset + offs_n[None, :]
    mask = row_valid[:, None] & col_valid[None, :]
    tl.store(y, tl.load(y, mask=mask) + acc, mask=mask)


@triton.jit
def lora_expand_kernel(
    y_ptr,  # [T, N] float32, updated in place
    shrunk_ptr,  # [T, R] float32
    b_ptr,  # [S, n, R] float32
    token_slots_ptr,  # [T] int32, -1: no adapter
    slot_ranks_ptr,  # [S] int32
    num_tokens,
    n,
    offset,
    max_rank,  # R
    stride_y_row: tl.int64,
    stride_b_slot: tl.int64,
    stride_b_col: tl.int64,
    stride_shrunk_row: tl.int64,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """y[row, offset + j] += sum_k<r b[slot, j, k] * shrunk[row, k]; grid (row programs, column
    blocks of n). Rows without a slot or of rank 0 are left untouched."""
    program = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROWS == 1:
        row = program.to(tl.int64)
        slot = tl.load(token_slots_ptr + row)
        if slot < 0:
            return
        rank = tl.minimum(tl.load(slot_ranks_ptr + slot), max_rank)
        if rank <= 0:
            return
        _expand_row(
            y_ptr,
            shrunk_ptr,
            b_ptr,
            row,
            slot,
            rank,
            offs_n,
            n,
            offset,
            stride_y_row,
            stride_b_slot,
            stride_b_col,
            stride_shrunk_row,
            BLOCK_N,
            BLOCK_R,
        )
    else:
        rows = program * ROWS + tl.arange(0, ROWS)
        row_valid = rows < num_tokens
        slots = tl.load(token_slots_ptr + rows, mask=row_valid, other=-1)
        last = tl.max(slots, 0)
        if last < 0:
            return
        first = tl.min(tl.where(row_valid, slots, last), 0)
        if first == last:  # one slot for the whole block: tl.dot over the block
            rank = tl.minimum(tl.load(slot_ranks_ptr + last), max_rank)
            if rank > 0:
                _expand_block(
                    y_ptr,
                    shrunk_ptr,
                    b_ptr,
                    rows,
                    row_valid,
                    last,
                    rank,
                    offs_n,
                    n,
                    offset,
                    stride_y_row,
                    stride_b_slot,
                    stride_b_col,
                    stride_shrunk_row,
                    ROWS,
                    BLOCK_N,
                    BLOCK_R,
                )
        else:  # mixed slots: row by row
            for i in range(ROWS):
                row = (program * ROWS + i).to(tl.int64)
                slot = tl.load(token_slots_ptr + row, mask=row < num_tokens, other=-1)
                if slot >= 0:
                    rank = tl.minimum(tl.load(slot_ranks_ptr + slot), max_rank)
                    if rank > 0:
                        _expand_row(
                            y_ptr,
                            shrunk_ptr,
                            b_ptr,
                            row,
                            slot,
                            rank,
                            offs_n,
                            n,
                            offset,
                            stride_y_row,
                            stride_b_slot,
                            stride_b_col,
                            stride_shrunk_row,
                            BLOCK_N,
                            BLOCK_R,
                        )


def lora_rows_per_program(num_tokens: int) -> int:
    """1 (BGMV) for decode-sized steps, ROW_BLOCK (SGMV) from ROW_BLOCK_MIN_TOKENS rows on."""
    return ROW_BLOCK if num_tokens >= ROW_BLOCK_MIN_TOKENS else 1


def check_lora_args(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    offset: int,
) -> None:
    """Raise ValueError unless the arguments fit `add_lora` (shapes, dtypes, devices)."""
    if y.dim() != 2 or x.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(
            f"add_lora takes y [T, N], x [T, K], a [S, R, K], b [S, n, R]; got y "
            f"{tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}."
        )
    (num_tokens, width), (num_slots, max_rank, k), n = y.shape, a.shape, b.shape[1]
    if x.shape[0] != num_tokens or token_slots.shape != (num_tokens,):
        raise ValueError(
            f"y has {num_tokens} rows but x {tuple(x.shape)} / token_slots "
            f"{tuple(token_slots.shape)} do not: both need one row per row of y."
        )
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but a [S, R, K] {tuple(a.shape)} has K={k}.")
    if b.shape[0] != num_slots or b.shape[2] != max_rank or slot_ranks.shape != (num_slots,):
        raise ValueError(
            f"a {tuple(a.shape)} is [S, R, K], so b must be [S, n, R] and slot_ranks [S]; got b "
            f"{tuple(b.shape)}, slot_ranks {tuple(slot_ranks.shape)}."
        )
    if not 0 <= offset <= width - n:
        raise ValueError(f"columns [{offset}, {offset + n}) of the slice do not fit y's {width}.")
    if y.dtype != torch.float32 or a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"y, a and b must be float32; got y {y.dtype}, a {a.dtype}, b {b.dtype}.")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, not {x.dtype}.")
    if token_slots.dtype != torch.int32 or slot_ranks.dtype != torch.int32:
        raise ValueError(
            f"token_slots and slot_ranks must be int32; got {token_slots.dtype}, "
            f"{slot_ranks.dtype}."
        )
    devices = {t.device for t in (y, x, a, b, token_slots, slot_ranks)}
    if len(devices) != 1:
        raise ValueError(
            f"add_lora's tensors must share one device; got {sorted(map(str, devices))}."
        )
    for name, tensor in (("y", y), ("a", a), ("b", b)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous.")


def add_lora_launches(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    offset: int = 0,
    *,
    shrunk: torch.Tensor | None = None,
    rows_per_program: int | None = None,
) -> list[KernelLaunch]:
    """The shrink and expand launches of `add_lora` (none when there is nothing to add).

    shrunk: the [T, R] float32 intermediate (allocated when None; only the entries below each
    row's rank are written and read). rows_per_program: 1 or a power of two >= 16 (None:
    `lora_rows_per_program`).

    Grids: shrink (row programs, rank blocks of ``SHRINK_BLOCK_R``), expand (row programs,
    column blocks of ``EXPAND_BLOCK_N``). The constexpr ``ROWS`` sets the rows per program:

    - ``ROWS == 1`` (BGMV): one program per row, a matrix-vector product over its slot's A / B.
      A row without an adapter, or a block past its slot's rank, returns at once. For decode-sized
      steps, whose neighbouring rows usually belong to different adapters.
    - ``ROWS >= 16`` (SGMV): ``ROWS`` consecutive rows per program. When they all share one slot
      (a prefill chunk), each A / B tile is read once for all of them and multiplied with
      ``tl.dot`` (IEEE float32); a block without any adapter returns at once; a block of mixed
      slots goes row by row, skipping the rows without one.

    Only ``k < r`` contributes (masked loads), so A / B past a slot's rank and the entries of
    ``shrunk`` the shrink did not write are never used. Rows and slots index with int64 strides.
    ``slot_ranks`` entries above R count as R (like the reference's slicing); slots must be
    ``< S`` (not checked: that would need a device sync).
    """
    check_lora_args(y, x, a, b, token_slots, slot_ranks, offset)
    (num_tokens, k), (num_slots, max_rank, _), n = x.shape, a.shape, b.shape[1]
    rows = lora_rows_per_program(num_tokens) if rows_per_program is None else rows_per_program
    if rows != 1 and (rows < 16 or rows & (rows - 1)):
        raise ValueError(f"rows_per_program must be 1 or a power of two >= 16, not {rows}.")
    if shrunk is None:
        shrunk = torch.empty((num_tokens, max_rank), dtype=torch.float32, device=x.device)
    elif shrunk.shape != (num_tokens, max_rank) or shrunk.dtype != torch.float32:
        raise ValueError(f"shrunk must be [{num_tokens}, {max_rank}] float32.")
    elif shrunk.stride(-1) != 1:
        raise ValueError("shrunk's last dimension must be contiguous.")
    if min(num_tokens, n, num_slots, max_rank) == 0:
        return []
    x = x if x.stride(-1) == 1 else x.contiguous()
    row_programs = triton.cdiv(num_tokens, rows)
    shrink_args = {
        "shrunk_ptr": shrunk,
        "x_ptr": x,
        "a_ptr": a,
        "token_slots_ptr": token_slots,
        "slot_ranks_ptr": slot_ranks,
        "num_tokens": num_tokens,
        "K": k,
        "max_rank": max_rank,
        "stride_x_row": x.stride(0),
        "stride_a_slot": a.stride(0),
        "stride_a_rank": a.stride(1),
        "stride_shrunk_row": shrunk.stride(0),
    }
    shrink_constexprs = {"ROWS": rows, "BLOCK_R": SHRINK_BLOCK_R, "BLOCK_K": SHRINK_BLOCK_K}
    expand_args = {
        "y_ptr": y,
        "shrunk_ptr": shrunk,
        "b_ptr": b,
        "token_slots_ptr": token_slots,
        "slot_ranks_ptr": slot_ranks,
        "num_tokens": num_tokens,
        "n": n,
        "offset": offset,
        "max_rank": max_rank,
        "stride_y_row": y.stride(0),
        "stride_b_slot": b.stride(0),
        "stride_b_col": b.stride(1),
        "stride_shrunk_row": shrunk.stride(0),
    }
    expand_constexprs = {"ROWS": rows, "BLOCK_N": EXPAND_BLOCK_N, "BLOCK_R": EXPAND_BLOCK_R}
    shrink_grid = (row_programs, triton.cdiv(max_rank, SHRINK_BLOCK_R))
    expand_grid = (row_programs, triton.cdiv(n, EXPAND_BLOCK_N))
    return [
        KernelLaunch(
            lora_shrink_kernel, shrink_grid, shrink_args, shrink_constexprs, NUM_WARPS, NUM_STAGES
        ),
        KernelLaunch(
            lora_expand_kernel, expand_grid, expand_args, expand_constexprs, NUM_WARPS, NUM_STAGES
        ),
    ]


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """y[:, offset:offset + n] += each row's LoRA delta, in place; returns y (see
    pagestream_kernels.reference.add_lora). One shrink and one expand launch for all rows."""
    for launch in add_lora_launches(y, x, a, b, token_slots, slot_ranks, offset):
        launch()
    return y
