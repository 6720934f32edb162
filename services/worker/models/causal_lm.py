"""The interface every model of the worker implements (native and transformers fallback).

    forward(input_ids [T] int64, positions [T] int64, kv_caches (one per layer,
            [2, num_blocks, block_size, num_kv_heads, head_dim]), attn_metadata) -> [T, hidden_size]
    compute_logits(hidden [R, hidden_size]) -> [R, vocab_size] float32

plus what the cache and the scheduler need: `kv_cache_spec` (num_layers, num_kv_heads,
head_dim, dtype), `vocab_size`, `eos_token_ids`, `max_model_len`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from pagestream_kernels.attention_metadata import AttentionMetadata
from services.worker.layers.attention import TORCH_ATTENTION, Attention, AttentionOps
from services.worker.models.kv_cache_spec import KVCacheGroups, KVCacheSpec


def normalize_token_ids(value: int | Sequence[int] | None) -> tuple[int, ...]:
    """An eos_token_id field (int, list or None) as a tuple of ints, duplicates removed."""
    if value is None:
        return ()
    items = [value] if isinstance(value, int) else list(value)
    return tuple(dict.fromkeys(int(item) for item in items))


def config_head_dim(config: PretrainedConfig) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def config_num_kv_heads(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def config_max_model_len(config: PretrainedConfig) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class CausalLM(nn.Module):
    """Base class: stores the HF config and derives the shared properties from it."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.get_text_config()
        # The loader overrides this from generation_config.json when the folder has one.
        self.eos_token_ids: tuple[int, ...] = normalize_token_ids(
            getattr(self.text_config, "eos_token_id", None)
        )
        self.attention_ops = TORCH_ATTENTION
        self.can_generate = True  # False: a pooling runner's model without an LM head
        self.bidirectional = False  # True: an encoder (every row sees its whole prompt)
        # an encoder's: its sentence-transformers folder's max_seq_length (set by the loader)
        self.max_seq_length: int | None = None
        self.num_labels = 0  # a classifier's labels (its pooled rows through pooled_head)

    @classmethod
    def reads_bidirectionally(cls, config: PretrainedConfig, pooling: bool) -> bool:
        """Whether the checkpoint's attention is bidirectional (an encoder, or a decoder
        family read as one by the pooling runner): the loader's plan builds it so."""
        return False

    def set_attention_ops(self, ops: AttentionOps) -> None:
        """Run every attention layer through `ops` (see resolve_attention_backend)."""
        self.attention_ops = ops
        for module in self.modules():
            if isinstance(module, Attention):
                module.ops = ops

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return config_num_kv_heads(self.text_config)

    @property
    def head_dim(self) -> int:
        return config_head_dim(self.text_config)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def max_model_len(self) -> int | None:
        """Its positions, or the shorter max_seq_length an encoder's sentence-transformers
        folder was trained to (a longer prompt is refused by name, or cut with
        truncate_prompt_tokens, rather than read past what the model was trained on)."""
        positions = self.max_positions
        if positions is None:
            return self.max_seq_length
        return min(positions, self.max_seq_length or positions)

    @property
    def max_positions(self) -> int | None:
        """The longest sequence its positions cover (None: the config does not say)."""
        return config_max_model_len(self.text_config)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the hidden states between layers (and pipeline stages): float32 on
        the CPU (a float32 residual stream around the weights' matmuls), else the model's."""
        return torch.float32 if self.device.type == "cpu" else self.dtype

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def kv_cache_groups(self) -> KVCacheGroups:
        """How the layers share block tables and what of them may be freed (one group of
        full attention unless the model says otherwise: nothing of its cache is freed)."""
        return KVCacheGroups.single(self.num_layers)
