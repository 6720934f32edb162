"""cpu/fused.cpp against the torch compositions it replaces (same rounding points)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagestream_kernels.cpu import fused_ops
from services.worker.layers.layernorm import rms_norm_torch

BF16_ULP = 2.0**-7  # a bfloat16 result may differ by one ulp (the float32 sum's order)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
        return
    torch.testing.assert_close(ours.float(), ref.float(), atol=1e-6, rtol=BF16_ULP * 1.01)
    assert (ours == ref).float().mean() > 0.98  # nearly all bit-equal


@pytest.mark.parametrize("rows", [1, 3, 200])
@pytest.mark.parametrize(("x_dtype", "w_dtype"), [("float32",) * 2, ("float32", "bfloat16")])
def test_rms_norm(rows, x_dtype, w_dtype):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(getattr(torch, x_dtype))
    w = (1 + 0.2 * torch.randn(576, generator=gen)).to(getattr(torch, w_dtype))
    _close(fused_ops.rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_add_rms_norm_sums_in_the_residual_dtype(rows, dtype):
    gen = torch.Generator().manual_seed(rows + 1)
    residual = torch.randn(rows, 576, generator=gen) * 4  # the CPU keeps it float32
    x = torch.randn(rows, 576, generator=gen).to(getattr(torch, dtype))
    w = (1 + 0.2 * torch.randn(576, generator=gen)).to(getattr(torch, dtype))
    total, normed = fused_ops.add_rms_norm(residual, x, w, 1e-6)
    assert torch.equal(total, residual + x)  # one float32 add, as torch's
    _close(normed, rms_norm_torch(residual + x, w, 1e-6))


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_silu_and_mul(rows, dtype):
    gen = torch.Generator().manual_seed(rows + 2)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 3).to(getattr(torch, dtype))
    gate, up = gate_up.chunk(2, dim=-1)
    _close(fused_ops.silu_and_mul(gate_up), F.silu(gate) * up)


def test_what_the_cpp_does_not_take_falls_back():
    x = torch.randn(4, 8)
    assert fused_ops.rms_norm(x.half(), torch.ones(8).half(), 1e-6) is None
    assert fused_ops.rms_norm(x.t(), torch.ones(4), 1e-6) is None  # not contiguous
    assert fused_ops.silu_and_mul(torch.randn(2, 7)) is None  # odd width
    assert fused_ops.add_rms_norm(x.bfloat16(), x, torch.ones(8), 1e-6) is None  # would upcast


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (64, 32)])
def test_rotary_of_a_strided_qkv_slice(dtype, head_dim, rotary_dim):
    from services.worker.layers.rotary_embedding import apply_rotary

    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    tokens, heads = 7, 5
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen).to(getattr(torch, dtype))
    qk = qkv[:, : heads * head_dim]  # rows strided, as the model passes them
    angles = torch.rand(tokens, 1, rotary_dim // 2, generator=gen) * 6
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    ours = fused_ops.rotary(qk, cos, sin, head_dim)
    ref = apply_rotary(qk.reshape(tokens, heads, head_dim), cos, sin).reshape(tokens, -1)
    _close(ours, ref)
