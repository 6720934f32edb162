"""VisionTransformer: the ViT body CLIP and SigLIP share (vision_spec.py says where they
differ): patch embeddings, pre-norm encoder layers (full attention over an image's
patches, a two-linear MLP) and an optional last norm. Each image (tile) is one sequence of
the batch; a patch mask hides padding patches as keys. The modules carry HF's names, so
the checkpoint's tensors load by name; the linears are torch's, in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.activation import activation
from services.worker.models.vision.patch_embeddings import PatchEmbeddings
from services.worker.models.vision.vision_spec import VisionSpec


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, N, hidden]; key_mask [B, 1, 1, N] bool (True: attend), or None."""
        batch, n, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, N, hidden] -> [B, heads, N, D]
            return t.view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # [B, heads, N, D]
        return self.out_proj(out.transpose(1, 2).reshape(batch, n, hidden))


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = activation(spec.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.self_attn = VisionAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The layers (a module of its own: HF's `encoder.layers.<i>` names)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(spec) for _ in range(spec.num_layers))


class VisionTransformer(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = PatchEmbeddings(spec)
        if spec.pre_norm:
            self.pre_layrnorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)  # HF's spelling
        self.encoder = VisionEncoder(spec)
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)

    def hidden_states(
        self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None, depth: int
    ) -> list[torch.Tensor]:
        """The first layer's input and the outputs of the first `depth` layers: depth + 1
        tensors [B, N, hidden] (HF's hidden_states, cut where the caller stops reading).
        patch_mask [B, h, w] bool: padding patches are no layer's keys."""
        if not 0 <= depth <= self.spec.num_layers:
            raise ValueError(f"depth {depth} is outside the tower's {self.spec.num_layers} layers")
        x = self.embeddings(pixel_values.to(self._dtype), patch_mask)  # [B, N, hidden]
        if self.spec.pre_norm:
            x = self.pre_layrnorm(x)
        key_mask = None if patch_mask is None else patch_mask.reshape(x.shape[0], 1, 1, -1)
        states = [x]
        for layer in self.encoder.layers[:depth]:
            x = layer(x, key_mask)
            states.append(x)
        return states

    def forward(
        self, pixel_values: torch.Tensor, patch_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every layer, then the last norm: [B, N, hidden]."""
        last = self.hidden_states(pixel_values, patch_mask, self.spec.num_layers)[-1]
        return self.post_layernorm(last)

    @property
    def _dtype(self) -> torch.dtype:
        return self.embeddings.patch_embedding.weight.dtype
