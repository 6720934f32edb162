"""Rotary position embedding (GPT-NeoX "rotate half" style) applied per token.

The inverse frequencies come from the model config: plain RoPE, or any scaled variant HF
transformers knows (linear, dynamic, llama3, yarn, longrope) through its ROPE_INIT_FUNCTIONS,
so the angles match HF bit for bit. cos/sin are computed on the fly from the per-token
`positions` ([num_tokens] int64), so there is no table to size or overflow.

M-RoPE (Qwen2.5-VL: rope parameters with an `mrope_section`) takes positions [3, T]
(temporal, row, column): the rotary frequencies are split into the three sections, each
rotated by its own axis' position (MRotaryEmbedding); [T] positions are all three equal.

"dynamic" NTK scaling is computed for sequences within max_position_embeddings (where it equals
HF's); HF rescales beyond that from the batch's longest sequence, which has no per-token
equivalent in a mixed batch.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from pagestream_kernels.cpu import fused_ops


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's RoPE settings as one dict (transformers 5 `rope_parameters` or 4.x keys)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """1 / theta^(2i / head_dim) for i in [0, head_dim / 2), float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)  # [head_dim // 2]


def compute_inv_freq(
    config: PretrainedConfig, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32, attention_scaling) for this config's RoPE type;
    `layer_type`: the parameters of that layer type, where the config holds one set per
    type (Gemma 3's sliding and full attention layers)."""
    params = rope_parameters(config)
    kwargs = {}
    if layer_type is not None:
        params, kwargs = dict(params[layer_type]), {"layer_type": layer_type}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1))
        rotary_dim = int(head_dim * float(partial or 1))  # HF: the first features only
        return default_inv_freq(rotary_dim, float(params["rope_theta"])), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported.")
    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention_scaling = init(config, torch.device("cpu"), **kwargs)
    return inv_freq.to(torch.float32), float(attention_scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of every head.

    x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, rotary_dim] float32.
    """
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot32 = x_rot.to(torch.float32)
    rotated = (x_rot32 * cos + rotate_half(x_rot32) * sin).to(x.dtype)
    if x_pass.shape[-1] == 0:
        return rotated
    return torch.cat((rotated, x_pass), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.shape[0]
        if self.rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} exceeds head_dim {head_dim}.")
        self.attention_scaling = attention_scaling
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        # (positions, a copy of them, cos, sin) of the last call: the layers of a model share
        # one RotaryEmbedding and see the same positions tensor every step.
        self._last: tuple[torch.Tensor, ...] | None = None

    @classmethod
    def from_config(
        cls, config: PretrainedConfig, head_dim: int, layer_type: str | None = None
    ) -> RotaryEmbedding:
        inv_freq, attention_scaling = compute_inv_freq(config, head_dim, layer_type)
        section = rope_parameters(config).get("mrope_section") if layer_type is None else None
        if section is not None:
            return MRotaryEmbedding(head_dim, inv_freq, attention_scaling, section)
        return cls(head_dim, inv_freq, attention_scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> cos, sin [num_tokens, 1, rotary_dim] float32."""
        inv_freq = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [num_tokens, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, rotary_dim]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [num_tokens, H * D], key [num_tokens, K * D] -> rotated, same shapes."""
        return self.rotate(positions, query), self.rotate(positions, key)

    def rotate(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Any number of heads at once: [num_tokens, N * D] -> rotated [num_tokens, N * D]
        (positions: [num_tokens], or M-RoPE's [3, num_tokens]).

        The query and key heads of a fused QKV output sit side by side, so a model can rotate
        both in one pass (half the kernel launches of rotating them apart).
        """
        num_tokens = positions.shape[-1]
        cos, sin = self.cached_cos_sin(positions)
        if heads.device.type == "cpu":
            fused = fused_ops.rotary(heads, cos, sin, self.head_dim)  # cpu/fused.cpp
            if fused is not None:
                return fused
        rotated = apply_rotary(heads.reshape(num_tokens, -1, self.head_dim), cos, sin)
        return rotated.reshape(num_tokens, -1)

    def cached_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin(positions), computed once per step: every layer sees the same tensor."""
        last = self._last
        if last is not None and last[0] is positions and torch.equal(last[1], positions):
            return last[2], last[3]
        cos, sin = self.cos_sin(positions)
        self._last = (positions, positions.clone(), cos, sin)
        return cos, sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}"


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: frequency i of the rotary (i < rotary_dim / 2) turns with the position on
    axis a(i), where the sections [temporal, row, column] cover the frequencies in order
    (HF's Qwen2.5-VL; sum(section) == rotary_dim / 2)."""

    def __init__(
        self,
        head_dim: int,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        section: list[int],
    ) -> None:
        super().__init__(head_dim, inv_freq, attention_scaling)
        if len(section) != 3 or min(section) < 0 or sum(section) != inv_freq.shape[0]:
            raise ValueError(
                f"mrope_section {list(section)} must be three sizes that sum to the rotary's "
                f"{inv_freq.shape[0]} frequencies."
            )
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.register_buffer("freq_axis", axis, persistent=False)  # [rotary_dim // 2]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, num_tokens] (or [num_tokens]: text only) -> cos, sin
        [num_tokens, 1, rotary_dim] float32."""
        if positions.dim() == 1:
            return super().cos_sin(positions)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [3, T]; got {list(positions.shape)}.")
        inv_freq = self.inv_freq.to(device=positions.device, dtype=torch.float32)
        freqs = positions.to(torch.float32)[:, :, None] * inv_freq  # [3, T, rot/2]
        axis = self.freq_axis.to(positions.device).expand(1, positions.shape[1], -1)
        picked = freqs.gather(0, axis)[0]  # [T, rot/2]: each frequency from its axis
        emb = torch.cat((picked, picked), dim=-1)[:, None, :]  # [T, 1, rotary_dim]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
