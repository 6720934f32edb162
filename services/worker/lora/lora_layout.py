"""Where each HF target module's LoRA lands in this rank's fused linears.

Column-parallel linears (qkv, gate_up) keep their rows of B (the output features this
rank computes) and all of A; row-parallel ones (o, down) keep their columns of A (the
input features this rank holds) and all of B, and their LoRA add goes into the partial
output before the all-reduce, which sums it like the base product.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from services.worker.models.causal_lm import config_head_dim, config_num_kv_heads

# Our fused linear -> the HF modules it holds, in output order.
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class SliceLayout:
    module: str  # the HF module name ("q_proj")
    out_offset: int  # the first column of this rank's fused output the slice writes
    out_src: int  # the first row of the checkpoint's B this rank keeps
    out_size: int
    in_src: int  # the first column of the checkpoint's A this rank keeps
    in_size: int


def linears_of(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's fused linears by name (the attention's only where the layer's MLP
    is a mixture of experts: adapters on experts are not supported)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
    if hasattr(mlp, "gate_up_proj"):
        linears.update(gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj)
    return linears


def slice_layouts(name: str, linear: nn.Module) -> tuple[SliceLayout, ...]:
    """This rank's slices of fused linear `name`."""
    modules = FUSED_MODULES[name]
    if name == "qkv_proj":
        return tuple(
            SliceLayout(module, *linear._ranges(shard), 0, linear.input_size)
            for module, shard in zip(modules, "qkv", strict=True)
        )
    if name == "gate_up_proj":
        slices = []
        for index, module in enumerate(modules):
            offset, size = linear.shard_range(index)
            slices.append(
                SliceLayout(module, offset, linear.tp_rank * size, size, 0, linear.input_size)
            )
        return tuple(slices)
    size = linear.input_size  # row-parallel: this rank's input features
    return (SliceLayout(modules[0], 0, 0, linear.output_size, linear.tp_rank * size, size),)


def model_modules(config) -> dict[str, list[int]]:
    """HF module -> [in_features, out_features] of the whole base linear (a mixture of
    experts': the attention's only, adapters on experts are not served)."""
    hidden, head_dim = config.hidden_size, config_head_dim(config)
    q = config.num_attention_heads * head_dim
    kv = config_num_kv_heads(config) * head_dim
    inter = config.intermediate_size
    attention = {
        "q_proj": [hidden, q],
        "k_proj": [hidden, kv],
        "v_proj": [hidden, kv],
        "o_proj": [q, hidden],
    }
    if getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0):
        return attention
    return {
        **attention,
        "gate_proj": [hidden, inter],
        "up_proj": [hidden, inter],
        "down_proj": [inter, hidden],
    }
