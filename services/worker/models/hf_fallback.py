"""Any other HF causal LM (GPT-2, OPT, ...) run by transformers with our paged KV cache.

It loads with `attn_implementation="pagestream"`, an attention function registered in
transformers' `AttentionInterface` that caches each layer's K/V into
`kv_caches[module.layer_idx]` and calls `paged_attention` (causal within each sequence;
transformers' mask path is a no-op). The flattened batch runs as batch 1 with explicit
per-token `position_ids`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch.nn import functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel

from pagestream_kernels.attention_metadata import AttentionMetadata
from services.common.model_errors import ModelLoadError
from services.worker.layers.attention import AttentionOps
from services.worker.models.causal_lm import CausalLM

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "pagestream"


@dataclass(frozen=True)
class _PagedStep:
    kv_caches: Sequence[torch.Tensor]
    attn_metadata: AttentionMetadata
    ops: AttentionOps


# The step being run by HFFallbackForCausalLM.forward in this thread/task.
_CURRENT_STEP: ContextVar[_PagedStep | None] = ContextVar("pagestream_paged_step", default=None)
# At load: the layers whose attention went through the interface in a probe forward.
_PROBED_LAYERS: ContextVar[set[int] | None] = ContextVar("pagestream_probe", default=None)
_NO_ATTENTION_INTERFACE = (
    "the model in {folder} picks its attention classes itself instead of through "
    "transformers' attention interface (or keeps a state outside attention), so pagestream "
    "cannot page its KV cache; this architecture is not supported yet."
)


def pagestream_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [1, H, T, D], key/value [1, K, T, D] ->
    ([1, T, H, D], None). attention_mask is ignored (the kernel masks causally)."""
    if kwargs.get("s_aux") is not None:  # gpt-oss: a learned sink logit per head
        raise NotImplementedError("attention sinks (s_aux) are not supported by the paged kernels")
    probed = _PROBED_LAYERS.get()
    if probed is not None:  # the load-time probe: plain causal attention, nothing cached
        probed.add(getattr(module, "layer_idx", -1))
        return _probe_attention(query, key, value, scaling), None
    step = _CURRENT_STEP.get()
    if step is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} only runs inside "
            "HFFallbackForCausalLM.forward (it needs the paged KV cache)."
        )
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx; cannot pick its KV cache.")
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    k = key[0].transpose(0, 1)  # [num_tokens, num_kv_heads, head_dim]
    v = value[0].transpose(0, 1)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    soft_cap = kwargs.get("softcap")
    out = step.ops.attend(
        q,
        k,
        v,
        step.kv_caches[layer_idx],
        step.attn_metadata,
        scale,
        sliding_window=int(window) if window else None,  # type: ignore[call-overload]
        soft_cap=float(soft_cap) if soft_cap else None,  # type: ignore[arg-type]
    )
    return out.unsqueeze(0), None  # [1, num_tokens, num_heads, head_dim]


def _probe_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """query [1, H, T, D], key/value [1, K, T, D] -> [1, T, H, D], causal, without a cache."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2)


def check_attention_interface(hf_model: PreTrainedModel, folder: Path) -> None:
    """Raise ModelLoadError unless every layer's attention of `hf_model` runs through our
    attention function: transformers loads some models with any attention name and then
    runs their own attention (or a recurrent state), which would ignore the paged cache.
    A two-token forward at load tells."""
    layers = int(hf_model.config.get_text_config().num_hidden_layers)
    probed: set[int] = set()
    token = _PROBED_LAYERS.set(probed)
    try:
        with torch.no_grad():
            hf_model.base_model(
                input_ids=torch.tensor([[1, 2]], device=hf_model.device),
                position_ids=torch.tensor([[0, 1]], device=hf_model.device),
                use_cache=False,
            )
    except NotImplementedError as exc:  # an attention option our kernels do not run
        raise ModelLoadError(
            f"the model in {folder} needs {exc}; this architecture is not supported yet."
        ) from exc
    except Exception as exc:  # a model that cannot run without its own attention state
        raise ModelLoadError(_NO_ATTENTION_INTERFACE.format(folder=folder)) from exc
    finally:
        _PROBED_LAYERS.reset(token)
    if probed != set(range(layers)):
        raise ModelLoadError(_NO_ATTENTION_INTERFACE.format(folder=folder))


def register_attention() -> None:
    """Register the "pagestream" attention implementation with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, pagestream_attention_forward)


class HFFallbackForCausalLM(CausalLM):
    """Wraps a transformers `*ForCausalLM` whose attention runs on our paged cache."""

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__(hf_model.config)
        self.hf_model = hf_model

    @classmethod
    def from_pretrained(
        cls, folder: Path, device: torch.device, dtype: torch.dtype
    ) -> HFFallbackForCausalLM:
        register_attention()
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
            )
        except SafetensorError as exc:
            raise ModelLoadError(
                f"weights in {folder} are corrupt or truncated ({exc}); copy or convert the "
                "model again."
            ) from exc
        except KeyError as exc:
            if exc.args == (ATTN_IMPLEMENTATION,):
                raise ModelLoadError(_NO_ATTENTION_INTERFACE.format(folder=folder)) from exc
            raise ModelLoadError(
                f"transformers cannot load {folder} as a causal LM: {exc}"
            ) from exc
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"transformers cannot load {folder} as a causal LM: {exc}"
            ) from exc
        check_attention_interface(hf_model, folder)
        logger.warning(
            "running %s through the transformers fallback: no tensor or pipeline "
            "parallelism, no native CPU step, no quantized weights (de-quantized), no LoRA",
            type(hf_model).__name__,
        )
        return cls(hf_model.requires_grad_(False).to(device).eval())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        token = _CURRENT_STEP.set(_PagedStep(kv_caches, attn_metadata, self.attention_ops))
        try:
            outputs = self.hf_model.base_model(
                input_ids=input_ids[None, :],  # [1, num_tokens]
                position_ids=positions[None, :],
                use_cache=False,
            )
        finally:
            _CURRENT_STEP.reset(token)
        return outputs[0][0]  # [num_tokens, hidden_size]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.hf_model.get_output_embeddings()(hidden_states).float()
        return scale_logits(logits, self.text_config)  # [num_rows, vocab_size]


def scale_logits(logits: torch.Tensor, config: object) -> torch.Tensor:
    """The logit post-processing some LM heads apply after the projection."""
    logit_scale = getattr(config, "logit_scale", None)  # Cohere: multiply
    if logit_scale:
        logits = logits * float(logit_scale)
    logits_scaling = getattr(config, "logits_scaling", None)  # Granite: divide
    if logits_scaling:
        logits = logits / float(logits_scaling)
    soft_cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2
    if soft_cap:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    return logits
