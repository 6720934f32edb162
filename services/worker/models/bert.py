"""BERT-family encoders for the pooling runner: BERT, RoBERTa, XLM-RoBERTa, MPNet.

HF's post-norm BertModel: word + position + token-type embeddings and their LayerNorm, then
per layer bidirectional self-attention and a GELU MLP, each followed by its residual
LayerNorm. RoBERTa's positions start after its padding id; MPNet has no token types,
numbers positions from 2 and adds T5's relative position bias. A cross-encoder adds its
classification head over the first row (`pooled_head`); a pair's second text is type 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from services.common.model_errors import ModelLoadError
from services.common.rank_info import RankInfo
from services.worker.layers.linear import LinearBase
from services.worker.models.encoder import Encoder, bidirectional_attention, pair_token_types

# Checkpoint prefixes of the same encoder under a task head (BertForMaskedLM: "bert.").
_PREFIXES = ("bert.", "roberta.", "mpnet.", "model.")
_MPNET_BUCKETS, _MPNET_MAX_DISTANCE = 32, 128  # HF's MPNet always buckets with these
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def relative_position_buckets(
    n: int, num_buckets: int, max_distance: int, device: torch.device
) -> torch.Tensor:
    """T5's bidirectional buckets of key position - query position: [n, n] int64 (half the
    buckets for keys before the query, exact near it, logarithmic out to max_distance)."""
    positions = torch.arange(n, device=device)
    distance = positions[:, None] - positions[None, :]  # query - key
    half = num_buckets // 2
    bucket = (distance < 0).long() * half
    distance = distance.abs()
    exact = half // 2
    far = (
        exact
        + (
            torch.log(distance.float().clamp(min=1) / exact)
            / math.log(max_distance / exact)
            * (half - exact)
        ).long()
    )
    return bucket + torch.where(distance < exact, distance, far.clamp(max=half - 1))


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, inter, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.qkv = LinearBase(hidden, 3 * hidden, bias=True)  # query, key, value rows
        self.attn_out = LinearBase(hidden, hidden, bias=True)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up = LinearBase(hidden, inter, bias=True)
        self.down = LinearBase(inter, hidden, bias=True)
        self.out_norm = nn.LayerNorm(hidden, eps=eps)
        if config.hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {config.hidden_act!r} is not supported for BERT")
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(
        self, x: torch.Tensor, starts: Sequence[int], biases: Sequence[torch.Tensor] | None
    ) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, -1).unbind(1)  # [T, H, D] each
        mixed = bidirectional_attention(q, k, v, starts, biases).reshape(rows, -1)
        x = self.attn_norm(x + self.attn_out(mixed))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(Encoder):
    """The encoder of a BERT / RoBERTa / XLM-RoBERTa / MPNet checkpoint (BertModel's
    names, or under a task head's "bert." / "roberta." / "mpnet." prefix); an embedding
    model's pooler layer is not used, a cross-encoder's head is."""

    reads_pairs = True  # its config needs sep_token_id (the loader reads the tokenizer's)

    def __init__(
        self,
        config: PretrainedConfig,
        rank: RankInfo | None = None,
        pooling: bool = True,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__(config, rank, pooling, expert_parallel)
        hidden = config.hidden_size
        self.position_offset = _position_offset(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        num_types = int(getattr(config, "type_vocab_size", 0) or 0)  # MPNet: none
        self.token_type_embeddings = nn.Embedding(num_types, hidden) if num_types else None
        self.relative_bias = None  # MPNet's [buckets, heads], shared by every layer
        if config.model_type == "mpnet":
            buckets = config.relative_attention_num_buckets
            self.relative_bias = nn.Embedding(buckets, config.num_attention_heads)
        self.embed_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        if self.num_labels:
            self.head_dense = LinearBase(hidden, hidden, bias=True)
            self.head_out = LinearBase(hidden, self.num_labels, bias=True)
        # the second text of a pair is token type 1 (None: every token is type 0)
        sep = getattr(config, "sep_token_id", None)
        self.sep_token_id = int(sep) if sep is not None and num_types > 1 else None

    @classmethod
    def unsupported(cls, config: PretrainedConfig, rank: RankInfo, pooling: bool) -> str | None:
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            return f"position_embedding_type {config.position_embedding_type!r} is not supported"
        if getattr(config, "is_decoder", False):
            return "a BERT decoder (is_decoder) is not supported"
        return super().unsupported(config, rank, pooling)

    @property
    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings) - self.position_offset

    def encode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        starts: Sequence[int],
        seq_lens: Sequence[int],
    ) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset
        )
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(
                pair_token_types(input_ids, starts, self.sep_token_id)
            )
        x = self.embed_norm(x)  # [T, hidden]
        biases = self._position_biases(seq_lens, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, starts, biases)
        return x

    def _position_biases(self, seq_lens, device, dtype) -> list[torch.Tensor] | None:
        """MPNet's relative position bias per sequence, [H, n, n] (None: no bias)."""
        if self.relative_bias is None:
            return None
        cached: dict[int, torch.Tensor] = {}
        for n in set(seq_lens):
            buckets = relative_position_buckets(n, _MPNET_BUCKETS, _MPNET_MAX_DISTANCE, device)
            cached[n] = self.relative_bias(buckets).permute(2, 0, 1).to(dtype)  # [H, n, n]
        return [cached[n] for n in seq_lens]

    def pooled_head(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.head_out(torch.tanh(self.head_dense(pooled)))

    def checkpoint_name(self, name: str) -> str | tuple[str, str] | None:
        return _our_name(name, self.num_labels > 0)


def _position_offset(config: PretrainedConfig) -> int:
    """Where a sequence's position ids start (HF's ids of an unpadded sequence): RoBERTa's
    after its padding id, MPNet's after its fixed padding index 1, BERT's at 0."""
    if config.model_type == "mpnet":
        return 2
    if config.model_type in ("roberta", "xlm-roberta", "camembert"):
        return int(config.pad_token_id) + 1
    return 0


_EMBEDDINGS = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
    "encoder.relative_attention_bias": "relative_bias",  # MPNet
}
_LAYER = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "attention.attn.o": "attn_out",  # MPNet's
    "attention.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "out_norm",
}


# A cross-encoder's head: BERT's pooler + classifier, RoBERTa's classification head.
_HEAD = {
    "pooler.dense": "head_dense",
    "classifier": "head_out",
    "classifier.dense": "head_dense",
    "classifier.out_proj": "head_out",
}


_QKV_PARTS = {"q": "query", "k": "key", "v": "value"}  # MPNet's names


def _our_name(name: str, with_head: bool) -> str | tuple[str, str] | None:
    """A checkpoint name as ours: a parameter, (qkv parameter, "query" | "key" | "value"),
    or None (an embedding model's pooler layer, position_ids buffers)."""
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    module, _, param = name.rpartition(".")
    if module in _HEAD:
        return f"{_HEAD[module]}.{param}" if with_head else None
    if module in _EMBEDDINGS:
        return f"{_EMBEDDINGS[module]}.{param}"
    if not module.startswith("encoder.layer."):
        return None
    index, _, rest = module.removeprefix("encoder.layer.").partition(".")
    for attention in ("attention.self.", "attention.attn."):  # BERT's, MPNet's
        if rest.startswith(attention) and rest != "attention.attn.o":
            part = rest.removeprefix(attention)
            return f"layers.{index}.qkv.{param}", _QKV_PARTS.get(part, part)
    if rest in _LAYER:
        return f"layers.{index}.{_LAYER[rest]}.{param}"
    return None
