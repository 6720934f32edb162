"""ModernBERT for the pooling runner (gte-modernbert, modernbert-embed; its rerankers).

A pre-norm encoder without position embeddings: per layer LayerNorm -> fused qkv -> rotary
-> bidirectional attention, and LayerNorm -> GeGLU MLP, each added to the residual (the
first layer reads the embeddings without a norm). Local layers (`layer_types`) see
`local_attention / 2` positions either side, each kind with its own rotary base. A
classifier pools its first row or the mean of its rows, then runs its head and classifier.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from services.common.rank_info import RankInfo
from services.worker.layers.linear import LinearBase
from services.worker.layers.rotary_embedding import RotaryEmbedding
from services.worker.models.encoder import Encoder, bidirectional_attention, window_mask

_LOCAL = "sliding_attention"


def _norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, index: int) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.attn_norm = nn.Identity() if index == 0 else _norm(config)
        self.qkv = LinearBase(hidden, 3 * hidden, bias=config.attention_bias)
        self.attn_out = LinearBase(hidden, hidden, bias=config.attention_bias)
        self.mlp_norm = _norm(config)
        self.up_gate = LinearBase(hidden, 2 * inter, bias=config.mlp_bias)
        self.down = LinearBase(inter, hidden, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_activation]
        self.local = config.layer_types[index] == _LOCAL

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        starts: Sequence[int],
        masks: Sequence[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        rows, hidden = x.shape
        qkv = self.qkv(self.attn_norm(x))  # [T, 3 * hidden]
        qk = rotary.rotate(positions, qkv[:, : 2 * hidden].contiguous())  # q and k heads
        q, k = qk.view(rows, 2, self.num_heads, -1).unbind(1)  # [T, H, D] each
        v = qkv[:, 2 * hidden :].reshape(rows, self.num_heads, -1)
        mixed = bidirectional_attention(q, k, v, starts, masks if self.local else None)
        x = x + self.attn_out(mixed.reshape(rows, hidden))
        up, gate = self.up_gate(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(self.act(up) * gate)


class ModernBertEncoder(Encoder):
    """ModernBertModel (or under a task head's "model." prefix)."""

    def __init__(
        self,
        config: PretrainedConfig,
        rank: RankInfo | None = None,
        pooling: bool = True,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__(config, rank, pooling, expert_parallel)
        hidden = config.hidden_size
        head_dim = hidden // config.num_attention_heads
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.embed_norm = _norm(config)
        self.layers = nn.ModuleList(
            ModernBertLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.final_norm = _norm(config)
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding.from_config(config, head_dim, kind)
                for kind in set(config.layer_types)
            }
        )
        self.half_window = int(config.local_attention) // 2
        if self.num_labels:
            self.classifier_pooling = str(config.classifier_pooling).upper()
            self.head_dense = LinearBase(hidden, hidden, bias=config.classifier_bias)
            self.head_act = ACT2FN[config.classifier_activation]
            self.head_norm = _norm(config)
            self.head_out = LinearBase(hidden, self.num_labels, bias=True)

    def encode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        starts: Sequence[int],
        seq_lens: Sequence[int],
    ) -> torch.Tensor:
        x = self.embed_norm(self.word_embeddings(input_ids))  # [T, hidden]
        masks = [window_mask(n, self.half_window, x.device) for n in seq_lens]
        for layer in self.layers:
            rotary = self.rotary[_LOCAL if layer.local else "full_attention"]
            x = layer(x, positions, rotary, starts, masks)
        return self.final_norm(x)

    def pooled_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.head_out(self.head_norm(self.head_act(self.head_dense(pooled))))

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("model.")
        if name.startswith(("head.", "classifier.")):
            if not self.num_labels:
                return None  # a masked-LM head
            return _HEAD.get(name.rpartition(".")[0], "") + "." + name.rpartition(".")[2]
        if name in _TOP:
            return _TOP[name]
        if not name.startswith("layers."):
            return None  # the masked-LM decoder
        index, _, rest = name.removeprefix("layers.").partition(".")
        module, _, param = rest.rpartition(".")
        return f"layers.{index}.{_LAYER[module]}.{param}" if module in _LAYER else None


_TOP = {
    "embeddings.tok_embeddings.weight": "word_embeddings.weight",
    "embeddings.norm.weight": "embed_norm.weight",
    "embeddings.norm.bias": "embed_norm.bias",
    "final_norm.weight": "final_norm.weight",
    "final_norm.bias": "final_norm.bias",
}
_LAYER = {
    "attn_norm": "attn_norm",
    "attn.Wqkv": "qkv",
    "attn.Wo": "attn_out",
    "mlp_norm": "mlp_norm",
    "mlp.Wi": "up_gate",
    "mlp.Wo": "down",
}
_HEAD = {"head.dense": "head_dense", "head.norm": "head_norm", "classifier": "head_out"}
