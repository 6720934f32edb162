"""The native CPU step of the Llama family: one C++ call runs a stage's decoder stack.

`NativeStep.build(model)` hands every layer's weights to `kernels/cpu/decoder_stack.cpp`
(packed once into the layout of its GEMM, `kernels/cpu/linear.cpp`) and frees the torch
copies, so the weights are held once; from then on `LlamaModel.forward` is the embedding
lookup, the step's cos/sin and one `DecoderStack.forward` over all of its layers, with the
residual stream, norms, rotary and attention in float32 and every matmul accumulating
and writing float32 around bfloat16 or float32 weights. With tensor parallelism the
row-parallel outputs are summed through `tp_all_reduce` inside the same call.

It applies on the CPU for float32 and bfloat16 weights with a SiLU MLP when the C++
extension builds here and its GEMM runs on this CPU; `unsupported_reason` says why not,
and the torch modules (the reference, and the path of every other device) run instead.
$PAGESTREAM_CPU_NATIVE=0 turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.attention_metadata import AttentionMetadata
from services.worker.layers.quantization.model_weights import weight_formats
from services.worker.parallel_state import tp_all_reduce

if TYPE_CHECKING:
    from services.worker.lora.lora_slots import LoRASlots

logger = logging.getLogger(__name__)

NATIVE_ENV = "PAGESTREAM_CPU_NATIVE"
_DTYPES = (torch.float32, torch.bfloat16)
_EMPTY_INT = torch.empty(0, dtype=torch.int32)


def _extension():
    from kernels import cpu

    return cpu.load()


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the native step cannot run `model` (a LlamaModel) here, or None."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return f"${NATIVE_ENV}=0"
    first = model.layers[model.layer_range.start]
    weight = first.mlp.down_proj.weight
    if weight.device.type != "cpu" or weight.dtype not in _DTYPES:
        return f"it runs float32 or bfloat16 on the CPU, not {weight.dtype} on {weight.device}"
    if first.mlp.act_fn.hidden_act != "silu":
        return f"the MLP's activation is {first.mlp.act_fn.hidden_act}, not silu"
    widths = (
        first.mlp.gate_up_proj.input_size,
        first.mlp.down_proj.input_size,
        first.self_attn.o_proj.input_size,
    )
    if weight.dtype == torch.bfloat16 and any(width % 2 for width in widths):
        return f"bfloat16 GEMMs take pairs of input features; the model has {widths}"
    try:
        module = _extension()
    except RuntimeError as exc:
        return str(exc)
    if not module.linear_supported(weight.dtype):
        return f"the CPU GEMM kernel does not run {weight.dtype} on this CPU"
    return None


def _bias(linear: nn.Module, applies: bool = True) -> torch.Tensor:
    return linear.bias.detach() if linear.bias is not None and applies else torch.empty(0)


def packed_linear(linear: nn.Module, bias: torch.Tensor) -> object:
    """`linear`'s weight packed for the C++ GEMM (kernels/cpu/linear.h): its quantized
    weight where it has one (services/worker/layers/quantization), else its float one."""
    packed_class = _extension().PackedLinear
    quantized = getattr(linear, "quantized", None)
    if quantized is None:
        return packed_class(linear.weight.detach(), bias)
    mins = quantized.mins if quantized.mins is not None else torch.empty(0)
    return packed_class.quantized(
        quantized.bits,
        quantized.codes,
        quantized.scales,
        mins,
        quantized.group_size,
        bias,
        quantized.source,
        linear.weight.dtype == torch.bfloat16,  # many rows in bfloat16 for a bfloat16 model
    )


def _release(linear: nn.Module) -> None:
    """The C++ stack holds its own packed copy: the torch weights are freed."""
    linear.weight.data = linear.weight.data.new_empty(0)
    linear.quantized = None


class NativeStep:
    """A pipeline stage's decoder stack as one C++ object (see the module docstring)."""

    def __init__(self, model: nn.Module, stack: object) -> None:
        self.model = model
        self.stack = stack
        self.rotary = model.layers[model.layer_range.start].self_attn.rotary_emb
        self.tp_size = model.stage.tensor_parallel_size
        self.lora: LoRASlots | None = None  # bound by bind_lora

    @classmethod
    def build(cls, model: nn.Module) -> NativeStep:
        """Packs `model`'s layers into a DecoderStack and frees their torch weights."""
        first = model.layers[model.layer_range.start]
        attn, mlp = first.self_attn.attn, first.mlp
        final_norm = model.norm.weight.detach() if model.stage.is_last_stage else torch.empty(0)
        stack = _extension().DecoderStack(
            first.input_layernorm.weight.shape[0],
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            mlp.down_proj.input_size,
            float(first.input_layernorm.eps),
            final_norm,
        )
        first_rank = model.stage.tp_rank == 0  # row-parallel biases are added once
        held = "+".join(sorted(set(weight_formats(first).values())))
        for index in model.layer_range:
            layer = model.layers[index]
            sa, mlp = layer.self_attn, layer.mlp
            stack.add_layer(
                packed_linear(sa.qkv_proj, _bias(sa.qkv_proj)),
                packed_linear(sa.o_proj, _bias(sa.o_proj, first_rank)),
                packed_linear(mlp.gate_up_proj, _bias(mlp.gate_up_proj)),
                packed_linear(mlp.down_proj, _bias(mlp.down_proj, first_rank)),
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                sa.attn.sliding_window or 0,
            )
            for linear in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj):
                _release(linear)
        logger.info(
            "native CPU step: %d layers in one C++ call per step (%s weights, float32 "
            "accumulation and activations)",
            len(model.layer_range),
            held,
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
    ) -> torch.Tensor:
        """LlamaModel.forward's contract: the last stage returns the final norm's float32
        output [T, hidden], other stages their hidden states. `layer_outputs` ([layers, T,
        hidden] float32), when given, receives each layer's output."""
        if self.model.stage.is_first_stage:
            hidden = self.model.embed_tokens(input_ids).to(torch.float32)  # [T, hidden]
        else:
            # a copy: the stack updates it in place
            hidden = hidden_states.to(
                torch.float32, memory_format=torch.contiguous_format, copy=True
            )
        num_tokens = hidden.shape[0]
        cos, sin = self.rotary.cached_cos_sin(positions)  # [T, 1, rotary_dim] float32
        last = self.model.stage.is_last_stage
        out = torch.empty_like(hidden) if last else torch.empty(0)
        md = attn_metadata
        self.stack.forward(
            hidden,
            cos.reshape(num_tokens, -1).contiguous(),
            sin.reshape(num_tokens, -1).contiguous(),
            list(kv_caches),
            md.slot_mapping.to(torch.int64).contiguous(),
            md.block_table.to(torch.int32).contiguous(),
            md.query_start_loc.to(torch.int32).contiguous(),
            md.seq_lens.to(torch.int32).contiguous(),
            tp_all_reduce if self.tp_size > 1 else None,
            layer_outputs if layer_outputs is not None else torch.empty(0),
            out,
            *self._lora_rows(),
        )
        return out if last else hidden
