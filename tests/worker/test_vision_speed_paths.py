"""The vision towers' fast CPU paths give the plain modules' results: q | k | v fused into
one oneDNN-packed linear, every linear packed, GELU inside fc1's kernel, no key mask when
no patch is padding (float32: to float32 rounding; bfloat16: to bfloat16's), and a
bfloat16 model's encode_image is HF's float32 one to bfloat16 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    Idefics3VisionConfig,
)

from services.common.config import ModelConfig
from services.common.rank_info import RankInfo
from services.worker.layers.packed_weight import packing_enabled
from services.worker.layers.quantization.model_weights import resident_weight_bytes
from services.worker.model_loader import load_model
from services.worker.models.idefics3 import Idefics3ForConditionalGeneration
from services.worker.models.vision.vision_linear import VisionLinear, fused
from services.worker.models.vision.vision_spec import VisionSpec
from services.worker.models.vision.vision_transformer import VisionTransformer
from tests.helpers.tiny_vlms import build_tiny_vlm
from tests.helpers.vlm_rows import hf_image_rows, image_input, processed

needs_packing = pytest.mark.skipif(not packing_enabled(), reason="this torch has no oneDNN")


def tiny_tower(dtype: torch.dtype, act: str = "gelu_pytorch_tanh") -> VisionTransformer:
    config = Idefics3VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        image_size=64, patch_size=16, hidden_act=act,
    )  # fmt: skip
    torch.manual_seed(0)
    tower = VisionTransformer(VisionSpec.siglip(config, bucketed_positions=True))
    for param in tower.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return tower.to(dtype).eval()


def patch_mask(padded: bool) -> torch.Tensor:
    """[2, 4, 4] bool: all patches real, or the second tile's right half padding."""
    mask = torch.ones(2, 4, 4, dtype=torch.bool)
    if padded:
        mask[1, :, 2:] = False
    return mask


@needs_packing
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu", "quick_gelu"])
@pytest.mark.parametrize("padded", [False, True])
def test_prepared_tower_equals_plain_float32(act, padded):
    plain = tiny_tower(torch.float32, act)
    prepared = copy.deepcopy(plain)
    prepared.prepare()
    layer = prepared.encoder.layers[0]
    assert layer.self_attn.qkv is not None and not hasattr(layer.self_attn, "q_proj")
    assert layer.mlp.fc1.packed is not None and layer.mlp.fc2.packed is not None
    assert (layer.mlp.gelu is None) == (act == "quick_gelu")
    pixels, mask = torch.randn(2, 3, 64, 64), patch_mask(padded)
    with torch.no_grad():
        torch.testing.assert_close(prepared(pixels, mask), plain(pixels, mask), atol=1e-5, rtol=0)


@needs_packing
def test_prepared_tower_bfloat16_within_its_rounding():
    reference = tiny_tower(torch.float32)
    prepared = copy.deepcopy(reference).to(torch.bfloat16)
    prepared.prepare()
    pixels, mask = torch.randn(2, 3, 64, 64), patch_mask(True)
    with torch.no_grad():
        out, want = prepared(pixels, mask), reference(pixels, mask)
    assert out.dtype == torch.bfloat16
    # LayerNorm'd rows of unit scale: bfloat16's 8 bits over 2 layers
    torch.testing.assert_close(out.float(), want, atol=0.1, rtol=0.05)


@needs_packing
@pytest.mark.parametrize("gelu", [None, "tanh", "none"])
def test_vision_linear_packed_equals_f_linear(gelu):
    torch.manual_seed(1)
    layer = VisionLinear(24, 40).eval()
    x = torch.randn(2, 5, 24)
    want = F.linear(x, layer.weight, layer.bias)
    want = want if gelu is None else F.gelu(want, approximate=gelu)
    layer.pack()
    assert layer.packed is not None and layer.weight.numel() == 0  # the plain copy freed
    torch.testing.assert_close(layer(x, gelu), want, atol=1e-6, rtol=0)
    assert layer(x[:, :0], gelu).shape == (2, 0, 40)


@needs_packing
def test_vision_linear_packed_refuses_another_dtype():
    layer = VisionLinear(8, 8)
    layer.pack()
    with pytest.raises(ValueError, match=r"packed for torch\.float32"):
        layer(torch.randn(3, 8, dtype=torch.bfloat16))


def test_fused_linear_stacks_outputs():
    torch.manual_seed(2)
    parts = [torch.nn.Linear(6, n) for n in (4, 3, 5)]
    joined = fused(parts)
    x = torch.randn(7, 6)
    with torch.no_grad():
        want = torch.cat([p(x) for p in parts], dim=-1)
        torch.testing.assert_close(joined(x), want)
    with pytest.raises(ValueError, match="all have a bias or all have none"):
        fused([torch.nn.Linear(6, 2), torch.nn.Linear(6, 2, bias=False)])


@needs_packing
def test_idefics3_bfloat16_encode_image_within_bfloat16_of_hf(tmp_path):
    """A bfloat16 model's image rows (packed bf16 linears, bf16 attention) against HF's
    float32 rows, at bfloat16's tolerance; the loader prepared the vision modules."""
    folder = build_tiny_vlm("idefics3", tmp_path / "vlm")
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder)
    model = load_model(ModelConfig(model=str(folder), dtype="bfloat16"), device="cpu")
    qkv = model.vision_model.encoder.layers[0].self_attn.qkv  # prepared at load
    assert qkv.packed is not None and qkv.packed.tensor.dtype == torch.bfloat16
    inputs = processed(processor, (64, 48), seed=3)
    rows = model.encode_image(image_input(model, inputs))
    reference = hf_image_rows(hf, inputs)
    assert rows.dtype == model.hidden_dtype and rows.shape == reference.shape
    scale = reference.abs().max().item()
    torch.testing.assert_close(rows.float(), reference, atol=0.02 * scale, rtol=0.02)


@needs_packing
def test_resident_bytes_count_the_packed_vision_linears():
    """The plain weights are freed once packed; the packed copies are what the model
    holds (oneDNN's blocks may pad them, never halve them)."""
    plain = tiny_tower(torch.float32)
    prepared = copy.deepcopy(plain)
    prepared.prepare()
    before, after = resident_weight_bytes(plain), resident_weight_bytes(prepared)
    assert before <= after < 2 * before


def test_a_later_pipeline_stage_has_no_vision_to_prepare(tmp_path):
    """Only the first stage holds the vision modules; the others' prepare is a no-op."""
    folder = build_tiny_vlm("idefics3", tmp_path / "vlm")
    config = AutoConfig.from_pretrained(folder)
    later = Idefics3ForConditionalGeneration(config, RankInfo(rank=1, pipeline_parallel_size=2))
    assert not hasattr(later, "vision_model")
    later.prepare_vision()
    first = Idefics3ForConditionalGeneration(config, RankInfo(pipeline_parallel_size=2))
    first.prepare_vision()
    assert first.vision_model.encoder.layers[0].self_attn.qkv is not None
