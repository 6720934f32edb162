"""NomicBERT for the pooling runner (nomic-embed-text v1 / v1.5, and its classifiers).

A post-norm encoder with rotary positions: word + token-type embeddings and their
LayerNorm, then per layer bidirectional attention (no biases; q and k rotated) and a
SwiGLU MLP, each added to the residual and then normalized; no final norm. A classifier
runs BERT's pooler and classifier; a pair's second text is token type 1, as in BERT.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from services.common.rank_info import RankInfo
from services.worker.layers.linear import LinearBase
from services.worker.layers.rotary_embedding import RotaryEmbedding
from services.worker.models.encoder import Encoder, bidirectional_attention, pair_token_types


class NomicBertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, inter, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        width = self.num_heads * self.head_dim
        self.qkv = LinearBase(hidden, 3 * width, bias=False)  # query, key, value rows
        self.attn_out = LinearBase(width, hidden, bias=False)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.gate_up = LinearBase(hidden, 2 * inter, bias=False)  # gate, up rows
        self.down = LinearBase(inter, hidden, bias=False)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = ACT2FN[config.hidden_act]

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        starts: Sequence[int],
    ) -> torch.Tensor:
        rows, width = x.shape[0], self.num_heads * self.head_dim
        qkv = self.qkv(x)  # [T, 3 * width]
        qk = rotary.rotate(positions, qkv[:, : 2 * width].contiguous())
        q, k = qk.view(rows, 2, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each
        v = qkv[:, 2 * width :].reshape(rows, self.num_heads, self.head_dim)
        mixed = bidirectional_attention(q, k, v, starts).reshape(rows, width)
        x = self.attn_norm(x + self.attn_out(mixed))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.mlp_norm(x + self.down(self.act(gate) * up))


class NomicBertEncoder(Encoder):
    """NomicBertModel (or under a task head's "nomic_bert." prefix)."""

    reads_pairs = True  # its config needs sep_token_id (the loader reads the tokenizer's)
    fused: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("query", "key", "value"),
        "gate_up": ("gate", "up"),
    }

    def __init__(
        self,
        config: PretrainedConfig,
        rank: RankInfo | None = None,
        pooling: bool = True,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__(config, rank, pooling, expert_parallel)
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        num_types = int(config.type_vocab_size or 0)
        self.token_type_embeddings = nn.Embedding(num_types, hidden) if num_types else None
        self.embed_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(NomicBertLayer(config) for _ in range(config.num_hidden_layers))
        self.rotary = RotaryEmbedding.from_config(config, config.head_dim)
        if self.num_labels:
            self.head_dense = LinearBase(hidden, hidden, bias=True)
            self.head_out = LinearBase(hidden, self.num_labels, bias=True)
        sep = getattr(config, "sep_token_id", None)
        self.sep_token_id = int(sep) if sep is not None and num_types > 1 else None

    def encode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        starts: Sequence[int],
        seq_lens: Sequence[int],
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(
                pair_token_types(input_ids, starts, self.sep_token_id)
            )
        x = self.embed_norm(x)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, positions, self.rotary, starts)
        return x

    def pooled_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.head_out(torch.tanh(self.head_dense(pooled)))

    def checkpoint_name(self, name: str) -> str | tuple[str, str] | None:
        """Both spellings: the files' (nomic's own: emb_ln, encoder.layers.N.attn.Wqkv,
        mlp.fc11 / fc12 / fc2, norm1 / norm2; what transformers saves) and transformers'
        module names (self_attn.q_proj, mlp.gate_proj, ...)."""
        name = name.removeprefix("nomic_bert.")
        module, _, param = name.rpartition(".")
        if module in _HEAD:
            return f"{_HEAD[module]}.{param}" if self.num_labels else None
        if module in _EMBEDDINGS:
            return f"{_EMBEDDINGS[module]}.{param}"
        module = module.removeprefix("encoder.")
        if not module.startswith("layers."):
            return None  # a masked-LM head
        index, _, rest = module.removeprefix("layers.").partition(".")
        if rest in _FUSED:
            target, part = _FUSED[rest]
            return f"layers.{index}.{target}.{param}", part
        return f"layers.{index}.{_LAYER[rest]}.{param}" if rest in _LAYER else None


_EMBEDDINGS = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
    "emb_ln": "embed_norm",
}
_HEAD = {
    "nomic_bert.pooler.dense": "head_dense",
    "pooler.dense": "head_dense",
    "classifier": "head_out",
}
_FUSED = {
    "self_attn.q_proj": ("qkv", "query"),
    "self_attn.k_proj": ("qkv", "key"),
    "self_attn.v_proj": ("qkv", "value"),
    "mlp.gate_proj": ("gate_up", "gate"),
    "mlp.up_proj": ("gate_up", "up"),
    "mlp.fc12": ("gate_up", "gate"),
    "mlp.fc11": ("gate_up", "up"),
}
_LAYER = {
    "self_attn.o_proj": "attn_out",
    "post_attention_layernorm": "attn_norm",
    "mlp.down_proj": "down",
    "post_mlp_layernorm": "mlp_norm",
    "attn.Wqkv": "qkv",  # q, k, v rows already joined
    "attn.out_proj": "attn_out",
    "mlp.fc2": "down",
    "norm1": "attn_norm",
    "norm2": "mlp_norm",
}
