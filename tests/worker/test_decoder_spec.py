"""The model description (services/worker/models/decoder_spec.py): what it reads from each
family's config, that the torch modules and the native step are built from it, and that the
native step's capability check runs over every layer and names the one it refuses.

Layer-by-layer equality of the two backends built from one description is
tests/worker/test_native_step.py's (float32 and bfloat16, every native family).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.common.config import ModelConfig
from services.worker.model_loader import load_model
from services.worker.models.decoder_spec import DecoderSpec
from services.worker.models.kv_cache_spec import KVCacheGroups
from services.worker.models.registry import native_model_class
from services.worker.native_step import unsupported_reason
from tests.helpers.tiny_models import tiny_config


def _spec(name: str) -> DecoderSpec:
    config = tiny_config(name)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return native_model_class(config.architectures).describe(config)


def test_each_family_is_described_from_its_config():
    llama, qwen2, mistral = _spec("llama"), _spec("qwen2"), _spec("mistral")
    assert (llama.num_layers, llama.hidden_size, llama.vocab_size) == (2, 64, 128)
    assert llama.rope_type == "llama3" and not llama.tie_word_embeddings
    first = llama.layers[0]
    assert (first.num_heads, first.num_kv_heads, first.head_dim) == (4, 2, 16)
    assert (first.qkv_bias, first.o_bias, first.activation) == (False, False, "silu")
    assert all((layer.qkv_bias, layer.o_bias) == (True, False) for layer in qwen2.layers)
    assert [layer.sliding_window for layer in mistral.layers] == [6, 6]
    assert _spec("llama_tied").tie_word_embeddings


def test_per_layer_windows_follow_layer_types():
    # Qwen2 with max_window_layers=1: layer 0 full attention, layer 1 a 5-token window
    assert [layer.sliding_window for layer in _spec("qwen2_sliding").layers] == [None, 5]


def test_the_torch_modules_are_built_from_the_description(tiny_model_dir):
    folder = tiny_model_dir("qwen2_sliding")
    config = ModelConfig(model=str(folder), dtype="float32", enforce_eager=True)
    model = load_model(config, device="cpu")
    spec = model.spec
    for index, layer in enumerate(model.model.layers):
        described = spec.layers[index]
        attn = layer.self_attn
        assert attn.attn.sliding_window == described.sliding_window
        assert (attn.qkv_proj.bias is not None) == described.qkv_bias
        assert (attn.o_proj.bias is not None) == described.o_bias
        assert layer.mlp.down_proj.input_size == described.intermediate_size
        assert layer.mlp.act_fn.hidden_act == described.activation


def test_the_native_stack_is_shaped_by_the_description(tiny_model_dir):
    model = load_model(ModelConfig(model=str(tiny_model_dir("mistral"))), device="cpu")
    assert model.model.native is not None
    assert model.model.native.stack.num_layers() == model.spec.num_layers


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(activation="relu"), "layer 1: its MLP's activation is relu"),
        (dict(norm_placement="post"), "layer 1: its norms sit post"),
        (dict(mlp="mixer"), "layer 1: its MLP is mixer"),
        (dict(mlp="moe", activation="gelu_pytorch_tanh"), "layer 1: its experts are not SiLU"),
        (dict(intermediate_size=128), "layer 1: its MLP's width differs"),
        (dict(head_dim=32), "layer 1: its sizes, activation or attention scale"),
        (dict(attention_scale=0.5), "layer 1: its sizes, activation or attention scale"),
    ],
)
def test_the_capability_check_names_the_layer_it_refuses(change, reason):
    spec = _spec("llama")
    layers = (spec.layers[0], replace(spec.layers[1], **change))
    changed = replace(spec, layers=layers)
    assert spec.native_unsupported(range(2), tp_size=1, bf16=False) is None
    assert changed.native_unsupported(range(2), tp_size=1, bf16=False).startswith(reason)
    # a pipeline stage that holds only layer 0 is not refused for layer 1
    assert changed.native_unsupported(range(1), tp_size=1, bf16=False) is None


def test_bfloat16_needs_even_widths_on_this_ranks_share():
    spec = _spec("llama")
    odd = replace(spec, layers=tuple(replace(layer, intermediate_size=98) for layer in spec.layers))
    assert odd.native_unsupported(range(2), tp_size=1, bf16=False) is None
    assert odd.native_unsupported(range(2), tp_size=2, bf16=True).startswith(
        "layer 0: bfloat16 GEMMs take pairs of input features"
    )


def test_a_refused_layer_keeps_the_torch_modules(tiny_model_dir):
    folder = tiny_model_dir("llama")
    model = load_model(ModelConfig(model=str(folder), dtype="float32"), device="cpu")
    spec = model.spec
    assert unsupported_reason(model.model, spec) is None
    refused = replace(spec, layers=(spec.layers[0], replace(spec.layers[1], norm="layer")))
    assert unsupported_reason(model.model, refused) == "layer 1: its norms are layer"


def test_the_capability_check_reads_every_layers_weights(tiny_model_dir):
    folder = tiny_model_dir("llama")
    config = ModelConfig(model=str(folder), dtype="float32", enforce_eager=True)
    model = load_model(config, device="cpu")  # the torch modules keep their weights
    down = model.model.layers[1].mlp.down_proj
    down.weight.data = down.weight.data.to(torch.float16)
    assert unsupported_reason(model.model, model.spec).startswith("layer 1: down is torch.float16")


def test_kv_cache_groups_of_a_hybrid_model():
    """Gemma 3's 5 local : 1 global over 12 layers: the 2 full layers form one group and
    the 10 windowed ones five more of 2, so a block holds 2 layers' KV; slot s of every
    group shares one cache tensor."""
    windows = [None if i % 6 == 5 else 512 for i in range(12)]
    groups = KVCacheGroups.from_windows(windows)
    assert groups.windows == (0, 512, 512, 512, 512, 512)
    assert groups.layers[0] == (5, 11) and groups.layers[1] == (0, 1)
    assert groups.group_size == 2
    placement = groups.placement()
    assert placement[5] == (0, 0) and placement[11] == (0, 1) and placement[4] == (3, 0)
    assert sorted(layer for group in groups.layers for layer in group) == list(range(12))
    # one kind only: one group (windowed everywhere: the widest window)
    assert KVCacheGroups.from_windows([4, 8, 8]) == KVCacheGroups.single(3, 8)
    assert KVCacheGroups.from_windows([None, None]) == KVCacheGroups.single(2)
    # more full layers than windowed: groups of the windowed count, the last one short
    mixed = KVCacheGroups.from_windows([None, None, None, 6, 6])
    assert mixed.windows == (0, 0, 6) and mixed.layers == ((0, 1), (2,), (3, 4))
