"""Tiny random HF decoders, one per family the engine runs: a config per name with a fixed
seed, every weight randomised (biases and norms included, so nothing is trivially 0 or 1)."""

from __future__ import annotations

import random

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

VOCAB = 128
_LLAMA_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(name: str) -> PretrainedConfig:
    if name == "llama":  # GQA, untied embeddings, llama3 RoPE scaling that changes inv_freq
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
            rope_theta=500000.0,
        )
        return LlamaConfig(**_LLAMA_COMMON, tie_word_embeddings=False, rope_parameters=scaling)
    if name == "llama_tied":
        return LlamaConfig(**_LLAMA_COMMON, tie_word_embeddings=True)
    if name == "qwen2":  # biases on q/k/v
        return Qwen2Config(**_LLAMA_COMMON, tie_word_embeddings=False)
    if name == "qwen2_sliding":  # layer 0 full attention, layer 1 a 5-token window
        return Qwen2Config(
            **_LLAMA_COMMON,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        )
    if name == "qwen3":  # q/k norms, a head_dim that is not hidden / heads, tied embeddings
        return Qwen3Config(**_LLAMA_COMMON, head_dim=32, tie_word_embeddings=True)
    if name == "qwen3_bias":  # Qwen3 with attention biases (q/k/v and o)
        return Qwen3Config(**_LLAMA_COMMON, attention_bias=True, tie_word_embeddings=False)
    if name == "smollm3":  # layer 1 of 2 without rotary (no_rope_layers [1, 0])
        return SmolLM3Config(
            **_LLAMA_COMMON, no_rope_layer_interval=2, pad_token_id=None, tie_word_embeddings=False
        )
    if name in _FAMILY_CONFIGS:
        return _FAMILY_CONFIGS[name]()
    if name == "mistral":  # a sliding window shorter than the test prompts
        return MistralConfig(**_LLAMA_COMMON, sliding_window=6, tie_word_embeddings=False)
    if name == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, eos_token_id=2
        )
    if name == "opt":
        return OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            eos_token_id=2,
        )
    raise KeyError(name)


def _gemma3_config() -> PretrainedConfig:
    """Gemma 3: sandwich (1 + w) norms, GeGLU, scaled embeddings, q/k norms,
    query_pre_attn_scalar != head_dim, sliding layers (6-token window) with their own
    rotary base around a full one with linear scaling, a final logit cap, tied."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
    }
    common = {**_LLAMA_COMMON, "num_hidden_layers": 3}
    return Gemma3TextConfig(
        **common,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=rope,
        final_logit_softcapping=5.0,
        tie_word_embeddings=True,
    )


def _phi4_config() -> PretrainedConfig:
    """Phi-4-mini's shape: fused qkv / gate_up tensors, 3/4 of each head
    rotated with longrope (its short factors: the tests stay within the 128 original
    positions; past them HF switches a whole forward to the long ones, see llama.py)."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        "original_max_position_embeddings": 128,
    }
    return Phi3Config(
        **_LLAMA_COMMON,
        rope_parameters=rope,
        original_max_position_embeddings=128,
        pad_token_id=None,
        sliding_window=None,
        tie_word_embeddings=True,
    )


def _mixtral_config() -> PretrainedConfig:
    """Mixtral: every MLP 4 experts, each token's top 2 renormalised."""
    return MixtralConfig(
        **_LLAMA_COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
    )


def _qwen2_moe_config() -> PretrainedConfig:
    """Qwen2-MoE: layer 0 dense (mlp_only_layers), layer 1 six experts of width 48, the top
    2 not renormalised, and a shared expert of width 80 behind its sigmoid gate."""
    return Qwen2MoeConfig(
        **_LLAMA_COMMON,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        mlp_only_layers=[0],
        norm_topk_prob=False,
        tie_word_embeddings=False,
    )


def _qwen3_moe_config() -> PretrainedConfig:
    """Qwen3-MoE: per-head q/k norms, head_dim 32, 4 experts of width 48, top 2
    renormalised."""
    return Qwen3MoeConfig(
        **_LLAMA_COMMON,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )


def _olmoe_config() -> PretrainedConfig:
    """OLMoE: q/k norms over all heads' features, q/k/v clamped to +-1.5 (which the
    random weights reach), 4 experts, top 2 not renormalised."""
    return OlmoeConfig(
        **_LLAMA_COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        clip_qkv=1.5,
        norm_topk_prob=False,
        pad_token_id=None,
        tie_word_embeddings=False,
    )


_FAMILY_CONFIGS = {
    "gemma3": _gemma3_config,
    "phi4": _phi4_config,
    "mixtral": _mixtral_config,
    "qwen2_moe": _qwen2_moe_config,
    "qwen3_moe": _qwen3_moe_config,
    "olmoe": _olmoe_config,
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def randomize_(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.15
            is_norm = param.dim() == 1 and (
                "norm" in name or ".ln_" in name or "layer_norm" in name
            )
            param.copy_(1.0 + noise if is_norm and name.endswith("weight") else noise)


def build_tiny_model(name: str, seed: int = 0, **overrides: object) -> PreTrainedModel:
    """`tiny_config(name)` with `overrides` set on it, its weights randomised from `seed`."""
    config = tiny_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model, seed)
    return model.eval()


def random_tokens(n: int, seed: int) -> list[int]:
    """`n` token ids past the special ones (0, 1, 2), from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]
