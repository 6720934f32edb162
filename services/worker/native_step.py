"""The native CPU step of the Llama family: one C++ call runs a stage's decoder stack.

`NativeStep.build(decoder)` packs every layer's weights into `pagestream_kernels/cpu`'s
DecoderStack (the torch copies are freed: the weights are held once); a step is then the
embedding lookup, the rotary tables' cos/sin and one `DecoderStack.forward`, with the
residual stream, norms, rotary and attention in float32 and every matmul accumulating in
float32. `step_unsupported` says where it cannot run (the loader's plan reads it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagestream_kernels.attention_metadata import AttentionMetadata
from services.common.model_errors import ModelLoadError
from services.worker.layers.fused_moe import FusedMoE
from services.worker.layers.linear import kv_heads_per_rank
from services.worker.layers.quantization.model_weights import weight_formats
from services.worker.parallel_state import tp_all_reduce

if TYPE_CHECKING:
    from services.worker.lora.lora_slots import LoRASlots
    from services.worker.models.decoder_spec import DecoderSpec

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)
_EMPTY_INT = torch.empty(0, dtype=torch.int32)


def _extension():
    from pagestream_kernels import cpu

    return cpu.load()


def step_unsupported(
    spec: DecoderSpec, layer_range: range, tp_size: int, dtype: torch.dtype
) -> str | None:
    """Why the native step cannot run layers `layer_range` of `spec` with `dtype` weights
    on this CPU (split over `tp_size` ranks), or None: what the C++ stack holds (the
    description), the weights' dtype, and whether the extension builds and its GEMM runs
    `dtype` here."""
    if dtype not in _DTYPES:
        return f"the weights are {dtype}; the native step runs float32 or bfloat16"
    reason = spec.native_unsupported(layer_range, tp_size, dtype == torch.bfloat16)
    if reason is not None:
        return reason
    try:
        module = _extension()
    except RuntimeError as exc:
        return str(exc)
    if not module.linear_supported(dtype):
        return f"the CPU GEMM kernel does not run {dtype} on this CPU"
    return None


def unsupported_reason(decoder: nn.Module, spec: DecoderSpec) -> str | None:
    """Why the native step cannot run the loaded `decoder` (a LlamaModel built from
    `spec`), or None: `step_unsupported` for each dtype its linears hold, each of which
    must be on the CPU."""
    tp_size = decoder.stage.tensor_parallel_size
    # the description first: a layer the C++ stack cannot hold may lack its linears
    reason = spec.native_unsupported(decoder.layer_range, tp_size, bf16=False)
    if reason is not None:
        return reason
    dtypes = set()
    for index in decoder.layer_range:
        for name, linear in _linears(decoder.layers[index]).items():
            weight = linear.weight
            if weight.device.type != "cpu" or weight.dtype not in _DTYPES:
                return (
                    f"layer {index}: {name} is {weight.dtype} on {weight.device}; the native "
                    "step runs float32 or bfloat16 on the CPU"
                )
            dtypes.add(weight.dtype)
    for dtype in sorted(dtypes, key=str):
        reason = step_unsupported(spec, decoder.layer_range, tp_size, dtype)
        if reason is not None:
            return reason
    return None


def _linears(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's linears by the C++ stack's names (a mixture's experts as
    "expert <j> gate_up" and so on, this rank's)."""
    sa, mlp = layer.self_attn, layer.mlp
    linears = {"qkv": sa.qkv_proj, "o": sa.o_proj}
    if not isinstance(mlp, FusedMoE):
        return {**linears, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    experts = {f"expert {j}": mlp.experts[j] for j in mlp.local_experts}
    if mlp.shared_expert is not None:
        experts["shared expert"] = mlp.shared_expert
    for name, expert in experts.items():
        linears.update({f"{name} gate_up": expert.gate_up_proj, f"{name} down": expert.down_proj})
    return linears


def _moe_weights(ext, moe: FusedMoE) -> object:
    """A mixture's weights for the C++ stack: this rank's experts packed (unset for the
    others), the router and the shared expert's gate in float32."""
    weights = ext.MoEWeights()
    weights.router = moe.gate.weight.detach().float()
    experts = [moe.experts[j] if j in moe.local_experts else None for j in range(moe.num_experts)]
    weights.gate_up = [_packed(ext, e.gate_up_proj if e else None) for e in experts]
    weights.down = [_packed(ext, e.down_proj if e else None) for e in experts]
    weights.top_k, weights.renormalize = moe.top_k, moe.renormalize
    if moe.shared_expert is not None:
        weights.shared_gate_up = _packed(ext, moe.shared_expert.gate_up_proj)
        weights.shared_down = _packed(ext, moe.shared_expert.down_proj)
        weights.shared_gate = moe.shared_expert_gate.weight.detach().float().reshape(-1)
    return weights


def _packed(ext, linear: nn.Module | None) -> object:
    """`linear` in the C++ stack's packed form (experts have no biases); unset for None."""
    return ext.PackedLinear() if linear is None else linear.to_native(torch.empty(0))


def _bias(linear: nn.Module, applies: bool = True) -> torch.Tensor:
    return linear.bias.detach() if linear.bias is not None and applies else torch.empty(0)


def _stack_config(ext, spec: DecoderSpec, stage) -> object:
    """The C++ stack's shape: this rank's share of the (uniform) layers' sizes."""
    first = spec.layers[0]
    tp = stage.tensor_parallel_size
    config = ext.StackConfig()
    config.hidden = spec.hidden_size
    config.num_heads = first.num_heads // tp
    config.num_kv_heads = kv_heads_per_rank(first.num_kv_heads, tp)
    config.head_dim = first.head_dim
    dense = [layer for layer in spec.layers if layer.mlp == "gated"] or [first]
    config.intermediate = dense[0].intermediate_size // tp  # the dense MLPs' (a mixture's: unused)
    config.eps = spec.norm_eps
    config.attention_scale = first.scale
    config.activation = first.activation
    return config


def _final_norm(model: nn.Module) -> torch.Tensor:
    return model.norm.weight.detach() if model.stage.is_last_stage else torch.empty(0)


def _layer_weights(ext, model: nn.Module, index: int) -> object:
    """Layer `index` of the decoder `model` as the C++ stack's LayerWeights (its linears
    packed, their torch copies freed)."""
    layer, spec = model.layers[index], model.spec.layers[index]
    linears = _linears(layer)
    weights = ext.LayerWeights()
    first_rank = model.stage.tp_rank == 0  # row-parallel biases are added once
    for name in ("qkv", "o", "gate_up", "down"):
        if name not in linears:  # a mixture's layer: its experts go below
            continue
        linear = linears[name]
        applies = first_rank or name in ("qkv", "gate_up")  # column-parallel biases
        setattr(weights, name, linear.to_native(_bias(linear, applies)))
    if isinstance(layer.mlp, FusedMoE):
        weights.moe = _moe_weights(ext, layer.mlp)
    weights.input_norm = layer.input_layernorm.weight.detach()
    weights.post_norm = layer.mlp_norm.weight.detach()
    if layer.sandwich:  # norms of the attention's and the MLP's outputs
        weights.attn_out_norm = layer.post_attention_layernorm.weight.detach()
        weights.mlp_out_norm = layer.post_feedforward_layernorm.weight.detach()
    weights.sliding_window = spec.sliding_window or 0
    kinds = list(model.rotaries)
    weights.rotary = kinds.index(spec.rope) if spec.rope in kinds else -1
    if spec.qk_norm:  # per head, or over all heads (OLMoE)
        weights.q_norm = layer.self_attn.q_norm.weight.detach()
        weights.k_norm = layer.self_attn.k_norm.weight.detach()
    weights.clip_qkv = spec.clip_qkv or 0.0
    weights.kv_group = model.layer_groups[index - model.layer_range.start]
    return weights


class NativeStep:
    """A pipeline stage's decoder stack as one C++ object (see the module docstring)."""

    def __init__(self, model: nn.Module, stack: object) -> None:
        self.model = model
        self.stack = stack
        # the rotary tables the layers index, in order
        self.rotaries = list(model.rotaries.values())
        self._ext = _extension()
        self.tp_size = model.stage.tensor_parallel_size
        self.lora: LoRASlots | None = None  # bound by bind_lora

    @classmethod
    def build(cls, model: nn.Module) -> NativeStep:
        """Packs the loaded decoder `model`'s layers into a DecoderStack (its shape from the
        model's description, this rank's share) and frees their torch weights; a
        ModelLoadError where its weights are not what the loader's plan promised."""
        reason = unsupported_reason(model, model.spec)
        if reason is not None:
            raise ModelLoadError(f"the native CPU step cannot run this model: {reason}")
        ext = _extension()
        stack = ext.DecoderStack(_stack_config(ext, model.spec, model.stage), _final_norm(model))
        held: set[str] = set()
        for index in model.layer_range:
            layer = model.layers[index]
            held |= {part for kind in weight_formats(layer).values() for part in kind.split("+")}
            stack.add_layer(_layer_weights(ext, model, index))
        logger.info(
            "native CPU step: %d layers in one C++ call per step (%s weights, float32 "
            "accumulation and activations)",
            len(model.layer_range),
            "+".join(sorted(held)),
        )
        return cls(model, stack)

    def bind_lora(self, slots: LoRASlots) -> None:
        """Hands the stack the adapter slots' tensors; the stack copies a slot into its own
        layout whenever an adapter is loaded into it, and each step's rows by slot go with
        forward."""
        names = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
        start = self.model.layer_range.start
        for (index, linear), slices in slots.linears.items():
            self.stack.set_lora(
                index - start,
                names[linear],
                [part.a for part in slices],
                [part.b for part in slices],
                [part.layout.out_offset for part in slices],
            )
        slots.on_load.append(self.stack.load_lora_slot)
        slots.group_rows = False
        self.lora = slots

    def _lora_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's slot [T] int32, each slot's rank [S] int32), empty without adapters."""
        batch = self.lora.batch if self.lora is not None else None
        if batch is None:
            return _EMPTY_INT, _EMPTY_INT
        return batch.token_slots, self.lora.ranks

    def weight_bytes(self) -> int:
        """Bytes of the packed weights of the stack."""
        return int(self.stack.weight_bytes())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
        layer_outputs: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """LlamaModel.forward's contract: the last stage returns the final norm's float32
        output [T, hidden], other stages their hidden states. `layer_outputs` ([layers, T,
        hidden] float32), when given, receives each layer's output; `inputs_embeds` [T,
        hidden], when given, is the first stage's input in place of input_ids' embeddings."""
        if self.model.stage.is_first_stage and inputs_embeds is None:
            hidden = self.model.embed(input_ids).to(torch.float32)  # [T, hidden]
        else:
            # a copy: the stack updates it in place
            given = hidden_states if inputs_embeds is None else inputs_embeds
            hidden = given.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        cos, sin = self._cos_sin(positions)  # [tables, T, rotary_dim] float32
        last = self.model.stage.is_last_stage
        out = torch.empty_like(hidden) if last else torch.empty(0)
        md = attn_metadata
        args = self._ext.StepArgs()
        args.hidden = hidden
        args.cos, args.sin = cos, sin
        args.kv_caches = list(kv_caches)
        if md.groups:  # KV cache groups: [G, T] slots and [G, S, n] tables
            args.slot_mapping = torch.stack([g.slot_mapping for g in md.groups]).to(torch.int64)
            args.block_table = torch.stack([g.block_table for g in md.groups]).to(torch.int32)
        else:
            args.slot_mapping = md.slot_mapping.to(torch.int64).contiguous()
            args.block_table = md.block_table.to(torch.int32).contiguous()
        args.query_start_loc = md.query_start_loc.to(torch.int32).contiguous()
        args.seq_lens = md.seq_lens.to(torch.int32).contiguous()
        if md.key_limits is not None:  # image tokens that see their whole image
            args.key_limits = md.key_limits.to(torch.int32).contiguous()
        if self.tp_size > 1:
            args.all_reduce = tp_all_reduce
        if layer_outputs is not None:
            args.layer_outputs = layer_outputs
        args.out = out
        args.lora_slots, args.lora_ranks = self._lora_rows()
        self.stack.forward(args)
        return out if last else hidden

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each rotary table's cos and sin at `positions` ([T], or [3, T] for M-RoPE's
        temporal / height / width positions): [tables, T, rotary_dim] float32 (one empty
        table when no layer rotates)."""
        num_tokens = positions.shape[-1]
        if not self.rotaries:
            empty = torch.empty(1, num_tokens, 0)
            return empty, empty
        pairs = [rotary.cached_cos_sin(positions) for rotary in self.rotaries]
        cos = torch.stack([c.reshape(num_tokens, -1) for c, _ in pairs])
        sin = torch.stack([s.reshape(num_tokens, -1) for _, s in pairs])
        return cos, sin
