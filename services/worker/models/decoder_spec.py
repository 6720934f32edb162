"""A decoder model described once: what every layer is, whichever backend runs it.

A `DecoderSpec` holds the model-wide facts and one `LayerSpec` per layer (attention, window,
norms, MLP or mixture of experts); the torch modules (models/llama.py) and the native CPU
step (native_step.py) are built from it, and `native_unsupported` names the first layer the
C++ stack cannot run. New parts add their fields here and their op to each backend. Sizes
are the whole model's; a tensor-parallel rank's share is computed where modules are built.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from services.worker.layers.rotary_embedding import rope_parameters
from services.worker.models.causal_lm import config_head_dim, config_num_kv_heads

# What the C++ DecoderStack runs (pagestream_kernels/cpu/decoder_stack.cpp).
NATIVE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
NATIVE_NORMS = ("rms", "rms_unit_offset")  # the offset is folded into the weights at load
NATIVE_PLACEMENTS = ("pre", "sandwich")
NATIVE_MLPS = ("gated", "moe")


@dataclass(frozen=True)
class LayerSpec:
    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    activation: str  # of the gated MLP: act(gate) * up
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # None: full attention
    # RMSNorm with a weight w ("rms"), or with 1 + w (Gemma's "rms_unit_offset")
    norm: str = "rms"
    # "pre": norm -> attention -> residual, norm -> MLP -> residual; "sandwich" (Gemma):
    # norm -> attention -> norm -> residual, norm -> MLP -> norm -> residual
    norm_placement: str = "pre"
    # a norm over each head's queries and keys before rotary ("head": one weight [D] for
    # all, Qwen3 / Gemma 3), over all the queries' and all the keys' features ("all",
    # OLMoE), or none ("")
    qk_norm: str = ""
    mlp: str = "gated"  # "gated": dense gate/up/down; "moe": a mixture of gated experts
    num_experts: int = 0  # "moe": the experts, each a gated MLP of intermediate_size
    experts_per_token: int = 0  # "moe": the top k the router picks for each token
    renormalize: bool = True  # "moe": the top k's probabilities rescaled to sum to 1
    shared_expert_size: int = 0  # "moe": a shared expert's width (0: none)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv (OLMoE)
    # which rotary: "default" (the config's one set of parameters), a layer type whose own
    # parameters the config holds (Gemma 3: "sliding_attention", "full_attention"), or
    # "none" (SmolLM3's layers without position embedding)
    rope: str = "default"
    attention_scale: float | None = None  # None: head_dim ** -0.5

    @property
    def scale(self) -> float:
        """The attention's softmax scale."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def native_unsupported(self) -> str | None:
        """Why the C++ stack cannot run this layer, or None."""
        checks = (
            (self.activation in NATIVE_ACTIVATIONS, f"its MLP's activation is {self.activation}"),
            (self.norm in NATIVE_NORMS, f"its norms are {self.norm}"),
            (self.norm_placement in NATIVE_PLACEMENTS, f"its norms sit {self.norm_placement}"),
            (self.mlp in NATIVE_MLPS, f"its MLP is {self.mlp}"),
            (self.mlp != "moe" or self.activation == "silu", "its experts are not SiLU"),
        )
        for supported, reason in checks:
            if not supported:
                return reason
        return None


@dataclass(frozen=True)
class DecoderSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    norm_eps: float
    tie_word_embeddings: bool
    rope_type: str
    layers: tuple[LayerSpec, ...]
    embedding_scale: float = 1.0  # Gemma: the embeddings times sqrt(hidden_size)
    final_logit_softcapping: float | None = None  # cap * tanh(logits / cap)

    @classmethod
    def from_config(
        cls,
        config: PretrainedConfig,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm: str = "",
        norm: str = "rms",
        norm_placement: str = "pre",
        embedding_scale: float = 1.0,
        moe: bool = False,
    ) -> DecoderSpec:
        """The Llama family's description of `config`: attention biases from
        `attention_bias` unless the family fixes them, windows per `layer_types`, `qk_norm`
        where the family normalises each head's queries and keys (Qwen3, Gemma 3), the
        norms' kind and placement and the embeddings' scale where the family fixes them
        (Gemma); each layer's rotary per `layer_types` and `no_rope_layers`, the attention
        scale per `query_pre_attn_scalar`; with `moe`, the sparse layers' experts and
        routing (`moe_layer`)."""
        bias = bool(getattr(config, "attention_bias", False))
        family = {
            "qkv_bias": bias if qkv_bias is None else qkv_bias,
            "o_bias": bias if o_bias is None else o_bias,
            "qk_norm": qk_norm,
            "norm": norm,
            "norm_placement": norm_placement,
        }
        layers = tuple(_layer(config, i, family, moe) for i in range(int(config.num_hidden_layers)))
        architectures = getattr(config, "architectures", None) or ["unknown"]
        return cls(
            architecture=architectures[0],
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=len(layers),
            norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_type=_rope_type(config, layers),
            layers=layers,
            embedding_scale=embedding_scale,
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        )

    def native_unsupported(self, layer_range: range, tp_size: int, bf16: bool) -> str | None:
        """Why the C++ stack cannot run layers `layer_range` of this model (split over
        `tp_size` ranks; `bf16`: bfloat16 weights, whose GEMMs take pairs of input
        features), naming the first layer it cannot, or None."""
        shape = _shape(self.layers[layer_range.start])
        dense = [i for i in layer_range if self.layers[i].mlp == "gated"]
        width = self.layers[dense[0]].intermediate_size if dense else None
        for index in layer_range:
            layer = self.layers[index]
            reason = layer.native_unsupported()
            if reason is None and _shape(layer) != shape:
                reason = (
                    "its sizes, activation or attention scale differ from the stage's first "
                    "layer's (one shape per stack)"
                )
            if reason is None and index in dense and layer.intermediate_size != width:
                reason = "its MLP's width differs from the stage's other dense layers'"
            if reason is None and bf16:
                widths = (
                    self.hidden_size,
                    layer.intermediate_size // tp_size,
                    layer.num_heads // tp_size * layer.head_dim,
                )
                if any(width % 2 for width in widths):
                    reason = f"bfloat16 GEMMs take pairs of input features; it has {widths}"
            if reason is not None:
                return f"layer {index}: {reason}"
        return None


def _shape(layer: LayerSpec) -> tuple:
    """What the C++ stack holds once for all of its layers (the dense MLPs' width too,
    checked apart: a mixture's experts have their own)."""
    sizes = layer.num_heads, layer.num_kv_heads, layer.head_dim
    return (*sizes, layer.activation, layer.scale)


def _layer(config: PretrainedConfig, index: int, family: dict[str, object], moe: bool) -> LayerSpec:
    """Layer `index` of `config` with the family's fixed fields (and, with `moe`, its
    experts where the layer is sparse)."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    fields: dict[str, object] = {
        "index": index,
        "num_heads": int(config.num_attention_heads),
        "num_kv_heads": config_num_kv_heads(config),
        "head_dim": config_head_dim(config),
        "intermediate_size": int(config.intermediate_size),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        "sliding_window": layer_sliding_window(config, index),
        "rope": layer_rope(config, index),
        "attention_scale": float(scalar) ** -0.5 if scalar else None,
        "activation": _activation(config),
        "clip_qkv": getattr(config, "clip_qkv", None),
        **family,
    }
    if moe:
        fields.update(moe_layer(config, index))
    return LayerSpec(**fields)  # type: ignore[arg-type]


def moe_layer(config: PretrainedConfig, layer_idx: int) -> dict[str, object]:
    """One layer's mixture-of-experts fields (LayerSpec), by the names each family's config
    uses: Mixtral's num_local_experts (its experts intermediate_size wide, always
    renormalised), Qwen2-MoE / Qwen3-MoE's num_experts, moe_intermediate_size,
    norm_topk_prob, the dense layers of mlp_only_layers and decoder_sparse_step, and
    Qwen2-MoE's shared_expert_intermediate_size; OLMoE's as Qwen's. {} for a dense layer."""
    experts = int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0))
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = layer_idx in (getattr(config, "mlp_only_layers", None) or ())
    if experts == 0 or dense or (layer_idx + 1) % step:
        return {}
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return {
        "mlp": "moe",
        "intermediate_size": int(width),
        "num_experts": experts,
        "experts_per_token": int(config.num_experts_per_tok),
        "renormalize": bool(getattr(config, "norm_topk_prob", True)),
        "shared_expert_size": int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
    }


def _activation(config: PretrainedConfig) -> str:
    """The gated MLP's activation (Gemma names it `hidden_activation`)."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return str(name)


def layer_rope(config: PretrainedConfig, layer_idx: int) -> str:
    """Which rotary one layer uses (LayerSpec.rope)."""
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not no_rope[layer_idx]:
        return "none"  # SmolLM3: 1 = rotary, 0 = none
    layer_types = getattr(config, "layer_types", None)
    params = getattr(config, "rope_parameters", None) or {}
    if layer_types is not None and layer_types[layer_idx] in params:
        return str(layer_types[layer_idx])  # Gemma 3: parameters per layer type
    return "default"


def _rope_type(config: PretrainedConfig, layers: tuple[LayerSpec, ...]) -> str:
    """The rotary scaling's type ("default", "llama3", ...), of the layers' first with
    parameters of their own where the config has them per layer type."""
    kinds = [layer.rope for layer in layers if layer.rope not in ("default", "none")]
    params = rope_parameters(config)
    if kinds:
        params = params[kinds[0]]
    return str(params.get("rope_type", "default"))


def layer_sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The attention window of one layer: per `layer_types` when the config has them."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window) if window else None
