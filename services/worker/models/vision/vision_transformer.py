"""VisionTransformer: the ViT body CLIP and SigLIP share (vision_spec.py says where they
differ): patch embeddings, pre-norm encoder layers (full attention over an image's
patches, a two-linear MLP) and an optional last norm. Each image (tile) is one sequence of
the batch; a patch mask hides padding patches as keys. The modules carry HF's names, so
the checkpoint's tensors load by name. `prepare` (once, after loading) makes the CPU form:
q | k | v fused, every linear oneDNN-packed in the model's dtype (vision_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.activation import activation
from services.worker.models.vision.patch_embeddings import PatchEmbeddings
from services.worker.models.vision.vision_linear import VisionLinear, fused
from services.worker.models.vision.vision_spec import VisionSpec

# HF's GELU activations -> F.gelu's approximation, which oneDNN's linear fuses
_GELU_APPROXIMATIONS = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}


class VisionAttention(nn.Module):
    """Loads q_proj, k_proj and v_proj by name; `prepare` fuses them into one linear."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.q_proj = VisionLinear(hidden, hidden)
        self.k_proj = VisionLinear(hidden, hidden)
        self.v_proj = VisionLinear(hidden, hidden)
        self.out_proj = VisionLinear(hidden, hidden)
        self.qkv: VisionLinear | None = None

    def prepare(self) -> None:
        """After loading: q | k | v as one packed linear (one pass over x), out_proj packed."""
        if self.qkv is None:
            self.qkv = fused([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj
            self.qkv.pack()
            self.out_proj.pack()

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, N, hidden]; key_mask [B, 1, 1, N] bool (True: attend), or None."""
        batch, n, hidden = x.shape
        if self.qkv is not None:
            qkv = self.qkv(x).view(batch, n, 3, self.num_heads, self.head_dim)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, N, D]
        else:
            q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # [B, heads, N, D]
        return self.out_proj(out.transpose(1, 2).reshape(batch, n, hidden))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, N, hidden] -> [B, heads, N, D]."""
        return t.view(*t.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.fc1 = VisionLinear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = VisionLinear(spec.intermediate_size, spec.hidden_size)
        self.act = activation(spec.activation)
        self.gelu = _GELU_APPROXIMATIONS.get(spec.activation)  # fc1 runs it

    def prepare(self) -> None:
        self.fc1.pack()
        self.fc2.pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu is not None:  # inside fc1's packed kernel: a pass less over [B, N, 4h]
            return self.fc2(self.fc1(x, self.gelu))
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
        key_mask = None  # no padding patch: SDPA's unmasked path (the same result)
        if patch_mask is not None and not bool(patch_mask.all()):
            key_mask = patch_mask.reshape(x.shape[0], 1, 1, -1)
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

    def prepare(self) -> None:
        """The layers' final form, made once after loading: fused, packed linears."""
        for layer in self.encoder.layers:
            layer.self_attn.prepare()
            layer.mlp.prepare()

    @property
    def _dtype(self) -> torch.dtype:
        return self.embeddings.patch_embedding.weight.dtype
