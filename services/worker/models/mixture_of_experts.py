"""The Llama family's mixtures of experts: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Each is LlamaForCausalLM (services/worker/models/llama.py) built from a description whose
sparse layers have `mlp = "moe"` (services/worker/layers/fused_moe.py runs them); what is
its own is reading each family's checkpoint names into one gated MLP per expert.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import PretrainedConfig

from services.worker.models.decoder_spec import DecoderSpec
from services.worker.models.llama import LlamaForCausalLM


class MixtureOfExpertsForCausalLM(LlamaForCausalLM):
    """Llama whose sparse layers' MLP is a mixture of gated experts (LayerSpec.mlp ==
    "moe", services/worker/layers/fused_moe.py), each expert loaded as its own gated MLP:
    the family's checkpoint names are mapped to ours (`checkpoint_renames`), and the
    stacked experts of checkpoints saved by transformers 5 (`mlp.experts.gate_up_proj`
    [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) split per expert."""

    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec.from_config(config, moe=True)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._per_expert(weights))

    def _per_expert(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for old, new in self.checkpoint_renames:
                name = name.replace(old, new)
            if name.endswith("mlp.experts.gate_up_proj"):
                base = name.removesuffix("gate_up_proj")
                for j, stacked in enumerate(tensor):  # [2I, H]: gate, then up
                    gate, up = torch.chunk(stacked, 2)
                    yield f"{base}{j}.gate_proj.weight", gate
                    yield f"{base}{j}.up_proj.weight", up
            elif name.endswith("mlp.experts.down_proj"):
                base = name.removesuffix("down_proj")
                yield from ((f"{base}{j}.down_proj.weight", w) for j, w in enumerate(tensor))
            else:
                yield name, tensor


class MixtralForCausalLM(MixtureOfExpertsForCausalLM):
    """Mistral whose every MLP is a mixture of num_local_experts experts, top
    num_experts_per_tok renormalised; its checkpoints name the mixture block_sparse_moe
    and each expert's gate / down / up projections w1 / w2 / w3."""

    checkpoint_renames = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w2.", ".down_proj."),
        (".w3.", ".up_proj."),
    )


class Qwen2MoeForCausalLM(MixtureOfExpertsForCausalLM):
    """Qwen2 (q/k/v biases) whose sparse layers (every decoder_sparse_step-th, less
    mlp_only_layers) mix num_experts experts of moe_intermediate_size, top k renormalised
    per norm_topk_prob, plus a shared expert behind a sigmoid gate."""

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec.from_config(config, qkv_bias=True, o_bias=False, moe=True)


class Qwen3MoeForCausalLM(MixtureOfExpertsForCausalLM):
    """Qwen3 (per-head q/k norms) with Qwen2-MoE's sparse layers, without a shared
    expert."""

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec.from_config(config, qk_norm="head", moe=True)


class OlmoeForCausalLM(MixtureOfExpertsForCausalLM):
    """OLMoE: an RMSNorm over all the queries' and all the keys' features, q / k / v
    clamped to +-clip_qkv where set, and every MLP a mixture of experts."""

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec.from_config(config, qk_norm="all", moe=True)
