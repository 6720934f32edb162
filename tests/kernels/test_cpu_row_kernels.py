"""cpu/row_kernels.h through the torch modules' ops: a row's result depends on that row alone,
however many rows the thread team splits a call into (the native step's batch invariance
rests on it), and a cache write that the team splits lands every row in its slot."""

from __future__ import annotations

import pytest
import torch

from pagestream_kernels import cpu, reference
from pagestream_kernels.cpu import fused_ops

ROWS = 300  # past the grain at these widths: the call runs on the whole team


def _each_alone(op, *row_tensors):
    return torch.cat([op(*(t[r : r + 1] for t in row_tensors)) for r in range(ROWS)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_of_a_batch_equal_each_row_alone(dtype):
    gen = torch.Generator().manual_seed(3)
    residual = torch.randn(ROWS, 576, generator=gen) * 4
    x = torch.randn(ROWS, 576, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(576, generator=gen)).to(dtype)
    assert torch.equal(
        fused_ops.rms_norm(x, w, 1e-6), _each_alone(lambda r: fused_ops.rms_norm(r, w, 1e-6), x)
    )
    total, normed = fused_ops.add_rms_norm(residual, x, w, 1e-6)
    alone = [
        fused_ops.add_rms_norm(residual[r : r + 1], x[r : r + 1], w, 1e-6) for r in range(ROWS)
    ]
    assert torch.equal(total, torch.cat([t for t, _ in alone]))
    assert torch.equal(normed, torch.cat([n for _, n in alone]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_rotary_of_a_batch_equal_each_row_alone(dtype):
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(ROWS, 2 * 1536, generator=gen) * 3).to(dtype)
    assert torch.equal(
        fused_ops.silu_and_mul(gate_up), _each_alone(fused_ops.silu_and_mul, gate_up)
    )
    heads, head_dim = 9, 64
    qkv = torch.randn(ROWS, (heads + 4) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : heads * head_dim]
    angles = torch.rand(ROWS, 1, head_dim // 2, generator=gen) * 6
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    together = fused_ops.rotary(qk, cos, sin, head_dim)
    assert torch.equal(
        together, _each_alone(lambda q, c, s: fused_ops.rotary(q, c, s, head_dim), qk, cos, sin)
    )


@pytest.mark.parametrize(("src", "dst"), [(torch.float32, torch.bfloat16), (torch.bfloat16,) * 2])
def test_a_cache_write_split_over_the_team_fills_every_slot(src, dst):
    gen = torch.Generator().manual_seed(5)
    tokens, heads, dim, block_size = 1000, 2, 64, 16
    key = torch.randn(tokens, heads, dim, generator=gen).to(src)
    value = torch.randn(tokens, heads, dim, generator=gen).to(src)
    slots = torch.randperm(tokens + 24, generator=gen)[:tokens]
    slots[::7] = -1  # padding rows: not written
    shape = (2, (tokens + 24) // block_size, block_size, heads, dim)
    ours = torch.full(shape, float("nan"), dtype=dst)
    expected = ours.clone()
    cpu.reshape_and_cache(key, value, ours, slots)
    reference.reshape_and_cache(key, value, expected, slots)
    assert torch.equal(ours.isnan(), expected.isnan())
    assert torch.equal(ours.nan_to_num(), expected.nan_to_num())
