"""Linear weights packed once into oneDNN's layout give F.linear's results (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.layers import packed_weight
from services.worker.layers.linear import MergedColumnLinear
from services.worker.layers.linear_weight import FloatWeight, OneDNNWeight
from services.worker.layers.matmul import linear
from services.worker.layers.packed_weight import PackedWeight
from services.worker.layers.quantization.model_weights import prepare_for_torch
from services.worker.layers.vocab_embedding import LMHead


def _exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return out + b.double() if b is not None else out


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_packed_and_plain_paths_agree_with_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    packed = PackedWeight.of(w)
    assert packed is not None
    assert packed.applies(x)
    for ours in (linear(x, w, b, packed), linear(x, w, b)):  # packed, then the plain path
        torch.testing.assert_close(ours.double(), _exact(x, w, b), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours, F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_bfloat16_packed_matmul_is_the_exact_product_rounded_once(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(128, 64, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    packed = PackedWeight.of(w)
    assert packed is not None and packed.applies(x)
    ours = linear(x, w, None, packed)
    assert ours.dtype == torch.bfloat16
    exact = _exact(x, w, None)
    # float32 accumulation, one rounding to bfloat16 (2^-8 relative) at the end
    torch.testing.assert_close(ours.double(), exact, atol=1e-3, rtol=2.0**-8 * 1.01)


def test_a_torch_without_onednn_keeps_plain_weights(monkeypatch):
    monkeypatch.setattr(packed_weight, "_OPS", None)
    layer = MergedColumnLinear(16, [8, 8])
    layer.weight.data.normal_()
    prepare_for_torch(torch.nn.Sequential(layer), torch.float32)
    assert isinstance(layer.weight_format, FloatWeight)
    assert layer.weight.numel() == 16 * 16


def test_other_dtypes_and_devices_are_not_packed():
    assert PackedWeight.of(torch.randn(8, 4).half()) is None
    assert PackedWeight.of(torch.randn(8, 4, device="meta")) is None


def test_the_torch_form_packs_the_layers_and_the_lm_head_keeps_its_plain_rows():
    gen = torch.Generator().manual_seed(0)
    fused = MergedColumnLinear(32, [16, 16])
    fused.weight.data = torch.randn(32, 32, generator=gen)
    head = LMHead(50, 32)
    head.weight.data = torch.randn(50, 32, generator=gen)
    x = torch.randn(9, 32, generator=gen)
    before = (fused(x), head(x))
    prepare_for_torch(torch.nn.Sequential(fused, head), torch.float32)
    assert isinstance(fused.weight_format, OneDNNWeight) and head.packed is not None
    assert head.weight.shape == (50, 32)  # the embedding lookup and rescoring read it
    assert fused.weight.numel() == 0  # the packed copy serves every row count: freed
    assert fused.weight_format.nbytes == 32 * 32 * 4
    assert fused(torch.empty(0, 32)).shape == (0, 32)
    torch.testing.assert_close(fused(x), before[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head(x), before[1], atol=1e-5, rtol=1e-5)
