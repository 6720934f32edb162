"""benchmarks/full_size.py: the random-weight checkpoints have the real models' shapes
(their parameter counts as published: Qwen2.5-1.5B 1.54B, Llama-3.1-8B 8.03B, Llama-3.2-1B
1.24B with its tied embedding counted once)."""

from __future__ import annotations

import math

import pytest

from benchmarks.full_size import SHAPES, full_config, tensor_shapes


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("qwen2.5-0.5b", 0.494),
        ("qwen2.5-1.5b", 1.544),
        ("llama-3.2-1b", 1.236),
        ("llama-3.1-8b", 8.030),
        ("qwen3-1.7b", 1.721),  # published: 1.7B, 1.4B without the embedding
        ("gemma-3-1b", 1.000),
    ],
)
def test_parameter_counts_are_the_real_models(name, billions):
    shapes = tensor_shapes(full_config(name))
    count = sum(math.prod(shape) for shape in shapes.values())
    assert count == pytest.approx(billions * 1e9, rel=2e-3)


def test_every_shape_has_a_consistent_config():
    for name in SHAPES:
        config = full_config(name)
        assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
        shapes = tensor_shapes(config)
        assert ("lm_head.weight" in shapes) != config["tie_word_embeddings"]
        assert sum(key.endswith("q_proj.weight") for key in shapes) == config["num_hidden_layers"]


def test_an_unknown_shape_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown shape 'gpt-5'"):
        full_config("gpt-5")


def test_the_scaled_mixture_and_its_dense_twin_have_the_same_active_parameters():
    moe = tensor_shapes(full_config("qwen3-30b-a3b-8l32e"))
    dense = tensor_shapes(full_config("qwen3-a3b-dense-8l"))
    config = full_config("qwen3-30b-a3b-8l32e")
    experts, active = config["num_experts"], config["num_experts_per_tok"]
    expert_params = sum(math.prod(s) for name, s in moe.items() if ".experts." in name)
    router = sum(math.prod(s) for name, s in moe.items() if name.endswith("mlp.gate.weight"))
    rest = sum(math.prod(s) for name, s in moe.items() if ".experts." not in name) - router
    assert rest == sum(math.prod(s) for name, s in dense.items() if ".mlp." not in name)
    dense_mlp = sum(math.prod(s) for name, s in dense.items() if ".mlp." in name)
    assert expert_params * active // experts == dense_mlp
    assert moe["model.layers.0.self_attn.q_norm.weight"] == (128,)
