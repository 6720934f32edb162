"""A linear's weight from its builder (services/worker/layers/weight_builder.py) to its
final form (linear_weight.py): loading shards (tensor-parallel narrowing included),
checking them, the torch path's form, the native step's form, each set once, bytes and
format names, against the float weight they stand for."""

from __future__ import annotations

import pytest
import torch

from services.worker.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from services.worker.layers.linear_weight import FloatWeight, NativeWeight, OneDNNWeight
from services.worker.layers.quantization import quantize_int4, quantize_int8
from services.worker.layers.quantization.loading import OnlineQuantization

GEN = torch.Generator().manual_seed(0)


def _weights(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN) * 0.1


def test_a_float_weight_loads_packs_and_goes_native():
    layer = MergedColumnLinear(32, [16, 16])
    gate, up = _weights(16, 32), _weights(16, 32)
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    assert isinstance(layer.weight_format, FloatWeight) and not layer.builder.quantized
    layer.finish_loading()
    assert isinstance(layer.weight_format, FloatWeight)
    x = _weights(5, 32)
    expected = x @ torch.cat([gate, up]).T
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)  # as loaded
    layer.prepare_for_torch(torch.float32)
    assert isinstance(layer.weight_format, OneDNNWeight | FloatWeight) and layer.builder is None
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert layer.weight_format.nbytes >= 32 * 32 * 4
    assert layer.weight_format.format == "float32"


def test_quantized_shards_join_in_their_formats_and_dequantize_for_torch():
    layer = QKVLinear(64, 16, num_heads=4, num_kv_heads=2)
    q, k, v = _weights(64, 64), _weights(32, 64), _weights(32, 64)
    parts = {"q": quantize_int4(q, 32), "k": quantize_int4(k, 32), "v": quantize_int8(v)}
    for name, part in parts.items():
        layer.weight.weight_loader(layer.weight, part, name)
    assert layer.builder.quantized
    layer.finish_loading()
    assert layer.format == "int4+int8" and layer.weight.numel() == 0  # the float one freed
    assert layer.builder.nbytes == sum(part.nbytes for part in parts.values())
    exact = torch.cat([part.dequantize() for part in parts.values()])
    layer.prepare_for_torch(torch.float32)
    assert isinstance(layer.weight_format, OneDNNWeight | FloatWeight) and layer.builder is None
    x = _weights(3, 64)
    torch.testing.assert_close(layer(x), x @ exact.T, atol=1e-5, rtol=1e-5)


def test_the_native_form_of_mixed_parts_equals_their_dequantized_weight():
    layer = QKVLinear(64, 16, num_heads=4, num_kv_heads=2, bias=True)
    q, k, v = _weights(64, 64), _weights(32, 64), _weights(32, 64)
    parts = {"q": quantize_int4(q, 32), "k": quantize_int4(k, 32), "v": quantize_int8(v)}
    for name, part in parts.items():
        layer.weight.weight_loader(layer.weight, part, name)
    bias = _weights(128)
    layer.bias.data.copy_(bias)
    layer.finish_loading()
    exact = torch.cat([part.dequantize() for part in parts.values()])
    native = layer.to_native(layer.bias.detach())
    assert isinstance(layer.weight_format, NativeWeight)
    assert native.format() == "int4+int8" and native.out_features() == 128
    x = _weights(2, 64)
    torch.testing.assert_close(
        native.forward(x, torch.empty(0), 0), x @ exact.T + bias, atol=1e-4, rtol=1e-5
    )


def test_online_quantization_runs_before_the_tensor_parallel_narrowing():
    """int8 per output channel over the whole row: rank 1's shard of a row-parallel layer
    holds the single-rank model's scales, not scales of its own half."""
    full = _weights(8, 64)
    single = quantize_int8(full)
    shard = RowLinear(64, 8, tp_rank=1, tp_size=2)
    shard.quantize_online(OnlineQuantization("int8"))
    shard.weight.weight_loader(shard.weight, full)
    shard.finish_loading()
    (held,) = shard.builder.parts.ordered()
    assert torch.equal(held.scales, single.scales)
    torch.testing.assert_close(held.dequantize(), single.dequantize()[:, 32:])


def test_missing_or_mixed_rows_are_refused():
    layer = QKVLinear(64, 16, num_heads=4, num_kv_heads=2)
    layer.weight.weight_loader(layer.weight, quantize_int8(_weights(64, 64)), "q")
    with pytest.raises(ValueError, match=r"rows \[64, 128\) of the weight were not loaded"):
        layer.finish_loading()
    mixed = QKVLinear(64, 16, num_heads=4, num_kv_heads=2)
    mixed.weight.weight_loader(mixed.weight, quantize_int8(_weights(64, 64)), "q")
    with pytest.raises(ValueError, match="a float checkpoint tensor cannot join"):
        mixed.weight.weight_loader(mixed.weight, _weights(32, 64), "k")


def test_the_final_form_is_made_once_from_the_builder():
    layer = RowLinear(64, 16)
    layer.weight.weight_loader(layer.weight, quantize_int8(_weights(16, 64)))
    assert layer.format == "int8"  # reported before the final form is made
    layer.finish_loading()
    layer.to_native(torch.empty(0))
    assert layer.builder is None and isinstance(layer.weight_format, NativeWeight)
    with pytest.raises(ValueError, match="finished: it takes no checkpoint tensors"):
        layer.weight.weight_loader(layer.weight, _weights(16, 64))
