"""Paged attention layer: writes this step's K/V into the cache, attends over the context.

It works on the flattened batch ([num_tokens, num_heads * head_dim], no padding) with the
step's `AttentionMetadata`. The kernels (causal within each sequence or up to each row's
key limit, GQA, sliding window, logit soft-cap) come from an `AttentionOps` backend:
"torch" (pagestream_kernels' reference), "cpu" and "triton" (loaded on first use; no key
limits), or one registered with `register_attention_backend`; `resolve_attention_backend`
picks one for --attention-backend.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagestream_kernels import paged_attention, reshape_and_cache
from pagestream_kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionOps:
    """One attention backend: the two kernels of `pagestream_kernels/`, same signatures."""

    name: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # The kernels take k_scale / v_scale keywords: an fp8 cache's per-tensor scales (stored
    # = x / scale), bound by `with_kv_scales`.
    takes_kv_scales: bool = False

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """One layer's attention for one step: cache this step's K/V, attend over the context.

        query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads,
        head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim]. An empty kv_cache (a memory-profiling run
        before the cache exists) skips attention and returns zeros.
        """
        if kv_cache.numel() == 0:
            return torch.zeros_like(query)
        self.reshape_and_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        return self.paged_attention(
            query, kv_cache, attn_metadata, scale, sliding_window=sliding_window, soft_cap=soft_cap
        )

    def with_kv_scales(self, k_scale: float, v_scale: float) -> AttentionOps:
        """These kernels with an fp8 cache's per-tensor scales bound (itself for 1.0, 1.0);
        ValueError for a backend whose kernels take none."""
        if (k_scale, v_scale) == (1.0, 1.0):
            return self
        if not self.takes_kv_scales:
            raise ValueError(f"attention backend {self.name!r} takes no KV cache scales.")
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        return dataclasses.replace(
            self,
            reshape_and_cache=functools.partial(self.reshape_and_cache, **scales),
            paged_attention=functools.partial(self.paged_attention, **scales),
        )


TORCH_ATTENTION = AttentionOps("torch", reshape_and_cache, paged_attention)
_BACKENDS: dict[str, AttentionOps] = {TORCH_ATTENTION.name: TORCH_ATTENTION}


def register_attention_backend(ops: AttentionOps) -> None:
    """Make `ops` selectable by its name (e.g. "triton")."""
    _BACKENDS[ops.name] = ops


def _load_triton(device: torch.device) -> AttentionOps:
    """pagestream_kernels.triton, imported on first use: importing this module needs no triton/GPU.

    On CPU the kernels run only through Triton's interpreter (TRITON_INTERPRET=1 set before
    the process imported triton); otherwise, or without triton, a ValueError says why.
    """
    try:
        from pagestream_kernels import triton as triton_kernels
    except ImportError as exc:
        raise ValueError(f"attention backend 'triton' is not available: {exc}") from exc
    reason = triton_kernels.unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention backend 'triton' is not available on {device.type}: {reason}.")
    return AttentionOps(
        "triton",
        triton_kernels.reshape_and_cache,
        triton_kernels.paged_attention,
        takes_kv_scales=True,
    )


def _load_cpu(device: torch.device) -> AttentionOps:
    """pagestream_kernels.cpu: decode attention in C++, built on first use (else ValueError)."""
    if device.type != "cpu":
        raise ValueError(f"attention backend 'cpu' runs on the CPU, not on {device.type}.")
    from pagestream_kernels import cpu as cpu_kernels

    reason = cpu_kernels.unavailable_reason()
    if reason is not None:
        raise ValueError(f"attention backend 'cpu' is not available: {reason}")
    return AttentionOps("cpu", cpu_kernels.reshape_and_cache, cpu_kernels.paged_attention)


# Backends built on first use for a device (registered ones take precedence).
_LAZY_BACKENDS: dict[str, Callable[[torch.device], AttentionOps]] = {
    "triton": _load_triton,
    "cpu": _load_cpu,
}


def resolve_attention_backend(name: str, device: torch.device) -> AttentionOps:
    """ "auto" -> triton on CUDA, cpu (C++ decode kernel) on the CPU, torch if that cannot
    load or elsewhere; other names must be registered or load for `device`, else a ValueError
    says why."""
    if name == "auto":
        preferred = {"cuda": "triton", "cpu": "cpu"}.get(device.type)
        if preferred is None:
            return TORCH_ATTENTION
        try:
            return resolve_attention_backend(preferred, device)
        except ValueError as exc:
            logger.warning("%s; using the torch attention backend", exc)
            return TORCH_ATTENTION
    if name in _BACKENDS:
        return _BACKENDS[name]
    if name in _LAZY_BACKENDS:
        return _LAZY_BACKENDS[name](device)
    raise ValueError(
        f"attention backend {name!r} is not available; have {', '.join(sorted(_BACKENDS))}."
    )


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged cache; `ops` is set by the model's
    `set_attention_ops` (default: the torch kernels)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})."
            )
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap
        # An fp8 cache's per-tensor (k_scale, v_scale): this layer's keys / values are stored
        # divided by them; 1.0 until calibrated scales are loaded (vLLM's default without).
        self.kv_scales = (1.0, 1.0)
        self.ops = TORCH_ATTENTION

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """query [num_tokens, H * D], key/value [num_tokens, K * D] -> [num_tokens, H * D]."""
        num_tokens = query.shape[0]
        out = self.ops.with_kv_scales(*self.kv_scales).attend(
            query.reshape(num_tokens, self.num_heads, self.head_dim),
            key.reshape(num_tokens, self.num_kv_heads, self.head_dim),
            value.reshape(num_tokens, self.num_kv_heads, self.head_dim),
            kv_cache,
            attn_metadata,
            self.scale,
            self.sliding_window,
            self.soft_cap,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}, backend={self.ops.name}"
        )
