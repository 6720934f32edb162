"""Native Llama family: Llama (llama3 RoPE scaling, SmolLM2), Mistral, Qwen2, Qwen3, SmolLM3
(layers without rotary), Phi-3 / Phi-4-mini and Gemma 3's text model, on the flattened batch
([num_tokens, hidden_size], no padding) with the paged KV cache. A family is a description
(decoder_spec.py) from which the decoder is built in the form the loader's ForwardPlan
names: the torch modules (LlamaModel) or the native CPU step over their loaded weights
(NativeLlamaModel), with causal or bidirectional attention. HF's separate q/k/v and
gate/up tensors fill the fused layers through `stacked_params_mapping`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from pagestream_kernels.attention_metadata import AttentionMetadata
from services.common.model_errors import ModelLoadError
from services.common.rank_info import RankInfo
from services.worker.layers.attention import Attention
from services.worker.layers.fused_moe import FusedMoE
from services.worker.layers.gated_mlp import GatedMLP
from services.worker.layers.layernorm import RMSNorm
from services.worker.layers.linear import QKVLinear, RowLinear, kv_heads_per_rank
from services.worker.layers.quantization.loading import split_rows
from services.worker.layers.rotary_embedding import RotaryEmbedding
from services.worker.layers.vocab_embedding import LMHead, VocabEmbedding
from services.worker.models.causal_lm import CausalLM, config_num_kv_heads
from services.worker.models.decoder_spec import DecoderSpec, LayerSpec
from services.worker.models.encoder import BidirectionalAttention
from services.worker.models.forward_plan import TORCH_CAUSAL, ForwardPlan
from services.worker.models.kv_cache_spec import KVCacheGroups, KVCacheSpec
from services.worker.models.weight_utils import default_weight_loader
from services.worker.native_step import NativeStep

logger = logging.getLogger(__name__)


def check_tensor_parallel(config: PretrainedConfig, tp_size: int) -> None:
    """Fail at start, naming the flag, when the heads cannot be split over tp_size."""
    heads, kv_heads = config.num_attention_heads, config_num_kv_heads(config)
    if heads % tp_size:
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide the model's {heads} attention "
            f"heads; use a tensor_parallel_size that divides {heads}."
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {tp_size}: the model's {kv_heads} KV heads are neither "
            "divisible by it nor divide it."
        )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        spec: LayerSpec,
        hidden_size: int,
        norm_eps: float,
        rotary: RotaryEmbedding | None,
        tp_rank: int = 0,
        tp_size: int = 1,
        bidirectional: bool = False,
    ) -> None:
        super().__init__()
        heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = QKVLinear(
            hidden_size, head_dim, heads, kv_heads, spec.qkv_bias, tp_rank, tp_size
        )
        self.o_proj = RowLinear(heads * head_dim, hidden_size, spec.o_bias, tp_rank, tp_size)
        # shared by the layers of its kind (cos/sin computed once per step); None: no rotary
        self.rotary_emb = rotary
        self.head_dim = head_dim
        # Qwen3, Gemma 3: a norm over each head's queries and keys (one weight [D] for all);
        # OLMoE: one over all the queries' features [H * D] and all the keys' [K * D]
        unit = spec.norm == "rms_unit_offset"
        self.per_head = spec.qk_norm == "head"
        if spec.qk_norm == "all" and tp_size > 1:
            raise ValueError(
                "this model's q/k norms span all heads (OLMoE), which tensor parallelism "
                f"would split; --tensor-parallel-size {tp_size} is not supported for it yet."
            )
        q_width, k_width = (1, 1) if self.per_head else (heads, kv_heads)
        self.q_norm = RMSNorm(q_width * head_dim, norm_eps, unit) if spec.qk_norm else None
        self.k_norm = RMSNorm(k_width * head_dim, norm_eps, unit) if spec.qk_norm else None
        self.clip_qkv = spec.clip_qkv  # OLMoE: q, k (after their norms) and v clamped
        self.attn = _attention(spec, tp_size, bidirectional)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, (H + 2K) * D]
        q, k, v = self.qkv_proj.split(qkv)
        # q and k are adjacent in qkv: rotate them as one [num_tokens, (H + K) * D] block
        qk = qkv[:, : q.shape[1] + k.shape[1]]
        if self.q_norm is not None:
            qk = torch.cat([self._qk_norm(self.q_norm, q), self._qk_norm(self.k_norm, k)], -1)
        if self.clip_qkv is not None:
            qk, v = qk.clamp(-self.clip_qkv, self.clip_qkv), v.clamp(-self.clip_qkv, self.clip_qkv)
        if self.rotary_emb is not None:
            qk = self.rotary_emb.rotate(positions, qk)
        q, k = qk.split([q.shape[1], k.shape[1]], dim=-1)
        attn_out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, H * D]
        return self.o_proj(attn_out)

    def _qk_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """`norm` over each head of x [num_tokens, heads * D] (or over all its features),
        in x's dtype."""
        if not self.per_head:
            return norm(x, x.dtype)
        heads = x.reshape(-1, self.head_dim)  # [num_tokens * heads, D]
        return norm(heads, x.dtype).reshape(x.shape)


def _attention(spec: LayerSpec, tp_size: int, bidirectional: bool) -> nn.Module:
    """The layer's attention: paged and causal, or bidirectional over each whole prompt (a
    windowed layer's within half its window either side, as HF's bidirectional sliding
    mask; one rank only, checked by LlamaForCausalLM)."""
    heads, kv_heads = spec.num_heads // tp_size, kv_heads_per_rank(spec.num_kv_heads, tp_size)
    if not bidirectional:
        return Attention(heads, spec.head_dim, spec.scale, kv_heads, spec.sliding_window)
    window = spec.sliding_window
    half_window = None if window is None else window - 1
    return BidirectionalAttention(heads, spec.head_dim, spec.scale, kv_heads, half_window)


class LlamaDecoderLayer(nn.Module):
    """One layer of the description: attention and gated MLP with their RMSNorms placed
    "pre" (HF's input_layernorm before the attention, post_attention_layernorm before the
    MLP) or "sandwich" (Gemma: input_layernorm and post_attention_layernorm around the
    attention, pre_ and post_feedforward_layernorm around the MLP)."""

    def __init__(
        self,
        spec: LayerSpec,
        model: DecoderSpec,
        rotary: RotaryEmbedding | None,
        tp_rank: int = 0,
        tp_size: int = 1,
        expert_parallel: bool = False,
        bidirectional: bool = False,
    ) -> None:
        super().__init__()
        hidden, eps = model.hidden_size, model.norm_eps
        unit = spec.norm == "rms_unit_offset"
        self.self_attn = LlamaAttention(spec, hidden, eps, rotary, tp_rank, tp_size, bidirectional)
        self.mlp = _mlp(spec, hidden, tp_rank, tp_size, expert_parallel)
        self.input_layernorm = RMSNorm(hidden, eps, unit)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit)
        self.sandwich = spec.norm_placement == "sandwich"
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit)
        self.dtype = torch.get_default_dtype()  # the matmuls' input dtype

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm of the MLP's input."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.sandwich:
            return self._sandwich(positions, hidden_states, kv_cache, attn_metadata)
        normed = self.input_layernorm(hidden_states)
        attn_out = self.self_attn(positions, normed, kv_cache, attn_metadata)
        hidden_states, normed = self.post_attention_layernorm.add_and_norm(hidden_states, attn_out)
        return hidden_states + self.mlp(normed)

    def _sandwich(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        residual = hidden_states.dtype
        normed = self.input_layernorm(hidden_states, self.dtype)
        attn_out = self.self_attn(positions, normed, kv_cache, attn_metadata)
        hidden_states = hidden_states + self.post_attention_layernorm(attn_out, residual)
        normed = self.pre_feedforward_layernorm(hidden_states, self.dtype)
        return hidden_states + self.post_feedforward_layernorm(self.mlp(normed), residual)


def _mlp(
    spec: LayerSpec, hidden_size: int, tp_rank: int, tp_size: int, expert_parallel: bool
) -> nn.Module:
    """The layer's MLP: one gated MLP, or a mixture of them (spec.mlp == "moe")."""
    if spec.mlp != "moe":
        return GatedMLP(
            hidden_size, spec.intermediate_size, spec.activation, spec.mlp_bias, tp_rank, tp_size
        )
    return FusedMoE(spec, hidden_size, tp_rank, tp_size, expert_parallel)


def residual_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """The residual stream's dtype: float32 on the CPU whatever the weights' (llama.cpp's
    mixed precision: bf16 weights and matmul inputs, everything added and normalised in
    float32, which keeps bf16 greedy outputs close to float32 for little cost); the
    model's own dtype elsewhere."""
    return torch.float32 if hidden_states.device.type == "cpu" else hidden_states.dtype


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The layers of one pipeline stage: an even split, earlier stages take the extra."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size ({pp_size}) is larger than the model's {num_layers} layers."
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


class LlamaModel(nn.Module):
    """The torch decoder: one pipeline stage of the decoder described by `spec`, run by its
    torch modules. Stage 0 embeds, the last stage applies the final norm; layers of other
    stages are left out (`nn.Identity` placeholders keep the checkpoint's layer numbering).
    `bidirectional`: every layer attends over each whole prompt and no layer reads the
    paged cache (one tiny cache in one group, as an Encoder's, only counts tokens)."""

    native: NativeStep | None = None  # no native step: the torch modules run every forward

    def __init__(
        self,
        config: PretrainedConfig,
        spec: DecoderSpec,
        rank: RankInfo,
        expert_parallel: bool = False,
        bidirectional: bool = False,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = rank.tp_rank, rank.tensor_parallel_size
        self.spec = spec
        self.stage = rank
        self.layer_range = stage_layers(spec.num_layers, rank.pipeline_parallel_size, rank.pp_rank)
        if rank.is_first_stage:
            self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, tp_rank, tp_size)
        # One RoPE per kind the layers use: cos/sin are computed once per step for each.
        self.rotaries = rotaries(config, spec)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                spec.layers[i],
                spec,
                self._rotary(spec.layers[i]),
                tp_rank,
                tp_size,
                expert_parallel,
                bidirectional,
            )
            if i in self.layer_range
            else nn.Identity()
            for i in range(spec.num_layers)
        )
        if rank.is_last_stage:
            unit = spec.layers[-1].norm == "rms_unit_offset"
            self.norm = RMSNorm(spec.hidden_size, spec.norm_eps, unit)
        # per layer of this stage: the KV cache group whose block table it reads, and the
        # step's cache it is handed
        self.kv_cache_groups, self.layer_groups, self.layer_caches = _cache_layout(
            spec, self.layer_range, bidirectional
        )

    def _rotary(self, layer: LayerSpec) -> RotaryEmbedding | None:
        return self.rotaries[layer.rope] if layer.rope in self.rotaries else None  # noqa: SIM401

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states: the previous stage's output (every stage but the first);
        inputs_embeds: the first stage's input rows [num_tokens, hidden_size] in place of
        embedding input_ids (a vision-language model's, images spliced in)."""
        if self.stage.is_first_stage:
            if inputs_embeds is None:
                inputs_embeds = self.embed(input_ids)  # [num_tokens, hidden_size]
            hidden_states = inputs_embeds.to(residual_dtype(inputs_embeds))
        layers = self.layers[self.layer_range.start : self.layer_range.stop]
        for layer, cache, group in zip(layers, self.layer_caches, self.layer_groups, strict=True):
            md = attn_metadata.group(group)
            hidden_states = layer(positions, hidden_states, kv_caches[cache], md)
        if not self.stage.is_last_stage:
            return hidden_states
        # In the residual's dtype: a float32 residual keeps its last norm in float32 too,
        # which the LM head's exact rescoring of its top candidates reads.
        return self.norm(hidden_states, hidden_states.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [num_tokens, hidden_size], times the family's scale
        (Gemma: sqrt(hidden_size), rounded to the embeddings' dtype as HF does)."""
        embedded = self.embed_tokens(input_ids)
        if self.spec.embedding_scale == 1.0:
            return embedded
        return embedded * torch.tensor(self.spec.embedding_scale, dtype=embedded.dtype)


class NativeLlamaModel(LlamaModel):
    """The native decoder: the same stage, built causal, whose torch modules only receive
    the checkpoint; `build_step` (the loader's last step, after the weights are loaded and
    finished) packs them into the NativeStep that runs every forward (native_step.py)."""

    def __init__(
        self,
        config: PretrainedConfig,
        spec: DecoderSpec,
        rank: RankInfo,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__(config, spec, rank, expert_parallel)
        self.native: NativeStep | None = None  # built by build_step

    def build_step(self) -> None:
        """Packs the loaded weights into the C++ stack (their torch copies are freed)."""
        self.native = NativeStep.build(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.native.forward(
            input_ids,
            positions,
            kv_caches,
            attn_metadata,
            hidden_states,
            inputs_embeds=inputs_embeds,
        )


def _cache_layout(
    spec: DecoderSpec, layer_range: range, bidirectional: bool
) -> tuple[KVCacheGroups, list[int], list[int]]:
    """The stage's KV cache groups, and per layer its group and the index of the step's
    cache it is handed: its own; bidirectional, the one bookkeeping cache (never read)."""
    num_layers = len(layer_range)
    if bidirectional:
        return KVCacheGroups.single(1), [0] * num_layers, [0] * num_layers
    groups = _kv_cache_groups(spec, layer_range)
    return groups, [g for g, _ in groups.placement()], list(range(num_layers))


def _kv_cache_groups(spec: DecoderSpec, layer_range: range) -> KVCacheGroups:
    """How the stage's layers share block tables: a hybrid model's full and windowed
    layers in groups of their own (KVCacheGroups); a pipeline stage keeps one group (its
    layers' window when every layer of the model has one)."""
    windows = [layer.sliding_window for layer in spec.layers]
    if len(layer_range) == len(windows):
        return KVCacheGroups.from_windows(windows)
    return KVCacheGroups.single(len(layer_range), max(windows) if all(windows) else 0)  # type: ignore[type-var]


def rotaries(config: PretrainedConfig, spec: DecoderSpec) -> nn.ModuleDict:
    """One RotaryEmbedding per rotary kind of the layers (LayerSpec.rope; "none" has none)."""
    head_dim = spec.layers[0].head_dim
    kinds = dict.fromkeys(layer.rope for layer in spec.layers if layer.rope != "none")
    return nn.ModuleDict(
        {
            kind: RotaryEmbedding.from_config(config, head_dim, None if kind == "default" else kind)
            for kind in kinds
        }
    )


class LlamaForCausalLM(CausalLM):
    # (fused param, checkpoint name, shard id): HF's separate tensors -> our fused layers.
    stacked_params_mapping: tuple[tuple[str, str, str | int], ...] = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    # Checkpoint tensors that are recomputed, never loaded.
    skipped_weight_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)

    def __init__(
        self,
        config: PretrainedConfig,
        rank: RankInfo | None = None,
        pooling: bool = False,
        expert_parallel: bool = False,
        plan: ForwardPlan = TORCH_CAUSAL,
    ) -> None:
        """`pooling`: a pooling runner's model, whose checkpoint may have no LM head (a
        base model saved by AutoModel): it then loads without one and only pools.
        `expert_parallel`: a mixture of experts' whole experts placed on the TP ranks
        instead of each expert split over them (services/worker/layers/fused_moe.py).
        `plan`: the decoder's form (model_loader.plan_forward): torch or native,
        causal or bidirectional (then it only pools: its prompts run whole)."""
        super().__init__(config)
        self.pooling = pooling
        self.rank = rank = rank or RankInfo()
        self.tp_size = rank.tensor_parallel_size
        check_tensor_parallel(config, self.tp_size)
        if plan.bidirectional and rank.world_size > 1:
            raise ModelLoadError(
                "a bidirectional encoder runs on one rank (no tensor or pipeline parallelism)"
            )
        spec = self.describe(config)
        if plan.native:
            self.model: LlamaModel = NativeLlamaModel(config, spec, rank, expert_parallel)
        else:
            self.model = LlamaModel(config, spec, rank, expert_parallel, plan.bidirectional)
        self.can_generate, self.bidirectional = not plan.bidirectional, plan.bidirectional
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.lm_head: LMHead | None = None
        if rank.is_last_stage:
            self.lm_head = LMHead(config.vocab_size, config.hidden_size, rank.tp_rank, self.tp_size)
            if self.tie_word_embeddings and rank.is_first_stage:
                self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        """The family's description of `config` (models/decoder_spec.py)."""
        return DecoderSpec.from_config(config)

    @property
    def spec(self) -> DecoderSpec:
        """The description the model was built from."""
        return self.model.spec

    @property
    def kv_cache_groups(self) -> KVCacheGroups:
        return self.model.kv_cache_groups

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (split, or one replicated head)."""
        return kv_heads_per_rank(config_num_kv_heads(self.config), self.tp_size)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        if self.bidirectional:
            return KVCacheSpec(1, 1, 1, self.dtype)  # bookkeeping only (bidirectional)
        num_layers = len(self.model.layer_range)  # this stage's layers
        groups = self.kv_cache_groups
        slots = tuple(s for _, s in groups.placement()) if groups.num_groups > 1 else ()
        return KVCacheSpec(num_layers, self.num_kv_heads, self.head_dim, self.dtype, slots)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds: the first stage's input rows (see LlamaModel.forward)."""
        return self.model(
            input_ids, positions, kv_caches, attn_metadata, hidden_states, inputs_embeds
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.lm_head is None:
            return None  # a pooling runner's model
        logits = self.lm_head(hidden_states)  # [num_rows, vocab_size] float32 (TP rank 0)
        cap = self.model.spec.final_logit_softcapping
        if cap and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def build_native_step(self) -> None:
        """The loader's build step of a native decoder, once its weights are loaded and
        finished: the decoder stack and the LM head packed for the C++ step."""
        self.model.build_step()
        if self.lm_head is not None:
            self.lm_head.pack_native()

    def _skip_weight(self, name: str) -> bool:
        if name.endswith(self.skipped_weight_suffixes):
            return True
        if not self.owns_weight(name):
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """HF's name for a tensor of a base-model checkpoint ("layers.0...", saved by
        AutoModel) as the causal LM names it ("model.layers.0...")."""
        return name if name.startswith(("model.", "lm_head.")) else "model." + name

    def owns_weight(self, name: str) -> bool:
        """Whether this pipeline stage holds the parameter a checkpoint tensor loads into."""
        name = self.checkpoint_name(name)
        if name.startswith("lm_head.") and self.lm_head is None:
            return False
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return index in self.model.layer_range and self._owns_expert(index, name)
        if name.startswith("model.embed_tokens."):
            return self.rank.is_first_stage or self._lm_head_from_embedding()
        if name.startswith(("model.norm.", "lm_head.")):
            return self.rank.is_last_stage
        return True

    def _owns_expert(self, index: int, name: str) -> bool:
        """False for an expert's tensor ("...experts.<j>...") that another rank holds
        under expert parallelism; True for every other tensor of layer `index`."""
        parts = name.split(".")
        if "experts" not in parts[:-2]:
            return True
        expert = parts[parts.index("experts") + 1]
        return not expert.isdigit() or int(expert) in self.model.layers[index].mlp.local_experts

    def _lm_head_from_embedding(self) -> bool:
        """Tied weights on a last stage that has no embedding: the head loads its copy."""
        head = self.lm_head is not None
        return head and self.tie_word_embeddings and not self.rank.is_first_stage

    def _target_param(self, name: str) -> tuple[str, str | int | None]:
        """The name of the parameter a checkpoint tensor loads into, and its shard id."""
        if name.startswith("model.embed_tokens.") and not self.rank.is_first_stage:
            return "lm_head.weight", None
        for fused, separate, shard_id in self.stacked_params_mapping:
            if separate in name:
                return name.replace(separate, fused), shard_id
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the parameter names that were filled.

        Raises ModelLoadError when a parameter got no tensor or a tensor has the wrong shape.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if self._skip_weight(name):
                continue
            target, shard_id = self._target_param(name)
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as exc:
                raise ModelLoadError(f"cannot load checkpoint tensor {name!r}: {exc}") from exc
            loaded.add(f"{target}#{shard_id}" if shard_id is not None else target)
        if unexpected:
            logger.warning(
                "ignored %d unexpected checkpoint tensors: %s",
                len(unexpected),
                ", ".join(unexpected[:8]),
            )
        headless = self.lm_head is not None and "lm_head.weight" not in loaded
        if self.pooling and headless and not self.tie_word_embeddings:
            logger.info("the checkpoint has no LM head (a base model): it pools, never generates")
            del params["lm_head.weight"]
            self.lm_head = None
            self.can_generate = False
        self._check_all_loaded(params, loaded)
        return {name.split("#")[0] for name in loaded}

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        expected: set[str] = set()
        for name in params:
            shard_ids = [
                sid for fused, _, sid in self.stacked_params_mapping if f"{fused}." in name
            ]
            if shard_ids:
                expected.update(f"{name}#{sid}" for sid in shard_ids)
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(
                f"checkpoint has no tensor for {len(missing)} parameter(s) of "
                f"{type(self).__name__}: {', '.join(missing[:8])}"
            )


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding attention window (config.sliding_window)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with biases on the q/k/v projections (none on o_proj)."""

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec.from_config(config, qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with an RMSNorm over each head's queries and keys before rotary (q_norm,
    k_norm), attention biases per `attention_bias`, and its own head_dim."""

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec.from_config(config, qk_norm="head")


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama whose layers listed 0 in `no_rope_layers` (every fourth) have no rotary."""


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model: (1 + w) RMSNorms before and after the attention and the MLP,
    q/k norms, a GeGLU (tanh) MLP, embeddings times sqrt(hidden_size), the attention
    scaled by query_pre_attn_scalar, sliding layers with their own rotary base (5 of 6 in
    the checkpoints) and tied embeddings."""

    @classmethod
    def describe(cls, config: PretrainedConfig) -> DecoderSpec:
        if getattr(config, "attn_logit_softcapping", None):
            raise ModelLoadError(
                "Gemma 3 with attn_logit_softcapping is not supported by the native model "
                f"(the config sets {config.attn_logit_softcapping}); Gemma 3 checkpoints do not."
            )
        return DecoderSpec.from_config(
            config,
            qk_norm="head",
            norm="rms_unit_offset",
            norm_placement="sandwich",
            embedding_scale=float(config.hidden_size) ** 0.5,
        )

    @classmethod
    def reads_bidirectionally(cls, config: PretrainedConfig, pooling: bool) -> bool:
        """EmbeddingGemma: `use_bidirectional_attention`, which HF honours for pooling."""
        return pooling and bool(getattr(config, "use_bidirectional_attention", False))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama whose checkpoints hold q/k/v as one qkv_proj and gate/up as one gate_up_proj
    (split here into the separate tensors every loader takes, so they shard as Llama's);
    Phi-4-mini rotates only the first partial_rotary_factor of each head, with longrope.
    Longrope uses its short factors at every position: HF's too within
    original_max_position_embeddings (4,096 for Phi-4-mini); past it HF switches a whole
    forward to the long factors by the batch's longest sequence, which has no per-token
    equivalent in a mixed batch (outputs there differ from HF's)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        layer = self.model.spec.layers[0]
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        for name, tensor in weights:
            if name.endswith("self_attn.qkv_proj.weight"):
                base = name.removesuffix("qkv_proj.weight")
                parts = split_rows(tensor, [q, kv, kv])  # float or quantized (GGUF) rows
                yield from zip([f"{base}{p}_proj.weight" for p in "qkv"], parts, strict=True)
            elif name.endswith("mlp.gate_up_proj.weight"):
                base = name.removesuffix("gate_up_proj.weight")
                half = tensor.shape[0] // 2
                gate, up = split_rows(tensor, [half, half])  # HF's order: gate, then up
                yield from ((f"{base}gate_proj.weight", gate), (f"{base}up_proj.weight", up))
            else:
                yield name, tensor
