"""Encoder: what every bidirectional encoder of the pooling runner shares (BERT's family,
ModernBERT, NomicBERT). A sequence's rows see its later tokens too, so each step holds
whole prompts (`PoolerConfig.whole_prompt`) and nothing is kept in the paged cache: the
step's own keys and values are all a query reads. The output is every row's last hidden
state; a classification checkpoint runs its head over the pooled row (`pooled_head`). A
subclass builds its layers, runs them in `encode` and names the checkpoint's tensors as its
own in `checkpoint_name` (a parameter, or (parameter, part) of a fused one, see `fused`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from pagestream_kernels.attention_metadata import AttentionMetadata
from services.common.model_errors import ModelLoadError
from services.common.rank_info import RankInfo
from services.worker.models.causal_lm import CausalLM
from services.worker.models.kv_cache_spec import KVCacheSpec


def bidirectional_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, H, D]
    starts: Sequence[int],  # [S + 1] host prefix sums of the sequences' rows
    biases: Sequence[torch.Tensor | None] | None = None,  # per sequence, added to scores
    scale: float | None = None,  # None: 1 / sqrt(D)
) -> torch.Tensor:
    """Each sequence's rows attend to all of its rows (no causal mask; a bias [H | 1, n, n]
    adds to a sequence's scores: a relative position bias, or -inf outside a window)."""
    out = torch.empty_like(q)
    for i, (begin, end) in enumerate(itertools.pairwise(starts)):
        # [1, H, n, D]: with a batch dimension the CPU runs its fused flash-attention
        # kernel (3-D inputs take the slower unfused math path)
        qs, ks, vs = (t[begin:end].transpose(0, 1)[None] for t in (q, k, v))
        bias = None if biases is None or biases[i] is None else biases[i][None]
        attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, scale=scale)
        out[begin:end] = attended[0].transpose(0, 1)
    return out


def window_mask(n: int, half_window: int, device: torch.device) -> torch.Tensor | None:
    """[1, n, n] bool: key j is seen from query i when |i - j| <= half_window (None: every
    key is, the sequence being no longer than the window)."""
    if n <= half_window + 1:
        return None
    positions = torch.arange(n, device=device)
    return ((positions[:, None] - positions[None, :]).abs() <= half_window)[None]


class BidirectionalAttention(nn.Module):
    """A decoder family's attention read bidirectionally (EmbeddingGemma: Gemma 3 with
    `use_bidirectional_attention`): in place of its paged causal attention, each whole
    prompt's rows attend to all of its rows, or to those within `half_window` positions
    either side on a windowed layer; the cache is neither written nor read."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        half_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads, self.half_window = num_kv_heads, half_window

    def forward(
        self,
        q: torch.Tensor,  # [T, H * D]
        k: torch.Tensor,  # [T, K * D]
        v: torch.Tensor,  # [T, K * D]
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        rows = q.shape[0]
        starts = attn_metadata.query_start_loc.tolist()
        group = self.num_heads // self.num_kv_heads
        q = q.view(rows, self.num_heads, self.head_dim)
        k, v = (
            t.view(rows, self.num_kv_heads, self.head_dim).repeat_interleave(group, dim=1)
            for t in (k, v)
        )  # [T, H, D]
        masks = None
        if self.half_window is not None:
            lens = attn_metadata.seq_lens.tolist()
            masks = [window_mask(n, self.half_window, q.device) for n in lens]
        out = bidirectional_attention(q, k, v, starts, masks, self.scale)
        return out.reshape(rows, -1)  # [T, H * D]


def pair_token_types(
    input_ids: torch.Tensor, starts: Sequence[int], sep_token_id: int | None
) -> torch.Tensor:
    """[T]: 1 for each sequence's tokens after its first [SEP] (a pair's second text, as
    BERT's tokenizer marks it), else 0."""
    types = torch.zeros_like(input_ids)
    if sep_token_id is None:
        return types
    is_sep = (input_ids == sep_token_id).long()
    for begin, end in itertools.pairwise(starts):
        seen = torch.cumsum(is_sep[begin:end], 0) - is_sep[begin:end]  # seps before
        types[begin:end] = (seen > 0).long()
    return types


class Encoder(CausalLM):
    # a fused parameter's module name -> its parts, in the order its rows join them
    fused: ClassVar[dict[str, tuple[str, ...]]] = {"qkv": ("query", "key", "value")}

    def __init__(
        self,
        config: PretrainedConfig,
        rank: RankInfo | None = None,
        pooling: bool = True,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__(config)
        reason = self.unsupported(config, rank or RankInfo(), pooling)
        if reason:
            raise ModelLoadError(f"{type(self).__name__}: {reason}")
        self.can_generate, self.bidirectional = False, True
        architectures = getattr(config, "architectures", None) or []
        classifies = any(a.endswith("ForSequenceClassification") for a in architectures)
        self.num_labels = int(config.num_labels) if classifies else 0  # 0: no head
        self.classifier_pooling = "CLS"  # which row(s) the head reads (ModernBERT: or MEAN)

    @classmethod
    def unsupported(cls, config: PretrainedConfig, rank: RankInfo, pooling: bool) -> str | None:
        """Why this encoder cannot run here (None: it can)."""
        if not pooling:
            return "an encoder only pools: run it with --runner pooling (embeddings)"
        if rank.tensor_parallel_size > 1 or rank.pipeline_parallel_size > 1:
            return "encoders run on one rank (no tensor or pipeline parallelism yet)"
        return None

    @classmethod
    def reads_bidirectionally(cls, config: PretrainedConfig, pooling: bool) -> bool:
        return True

    @property
    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """Nothing is kept in the cache: one tiny layer, so its blocks cost (almost) nothing."""
        return KVCacheSpec(1, 1, 1, self.dtype)

    @property
    def num_layers(self) -> int:
        return 1  # of cache: see kv_cache_spec

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        starts = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        if [end - begin for begin, end in itertools.pairwise(starts)] != seq_lens:
            raise RuntimeError("an encoder step must hold whole prompts (none was chunked)")
        return self.encode(input_ids, positions, starts, seq_lens)

    def encode(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        starts: Sequence[int],  # [S + 1]
        seq_lens: Sequence[int],  # [S]
    ) -> torch.Tensor:
        """The last hidden state of every row: [T, hidden]."""
        raise NotImplementedError

    def pooled_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """A classifier's logits [P, num_labels] from its pooled rows [P, hidden]."""
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an encoder has no LM head: it only pools")

    def checkpoint_name(self, name: str) -> str | tuple[str, str] | None:
        """A checkpoint tensor's name as ours: a parameter, (parameter, part) of a fused
        one, or None (not used: a masked-LM head, an embedding model's pooler layer)."""
        raise NotImplementedError

    def owns_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor loads into this encoder (skipped unread otherwise)."""
        return self.checkpoint_name(name) is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's tensors into ours; the parts of a fused parameter are joined
        along their rows once all have come."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            target = self.checkpoint_name(name)
            if target is None:
                continue
            if isinstance(target, tuple):
                key, part = target
                order = self.fused[key.rsplit(".", 2)[-2]]
                pending.setdefault(key, {})[part] = tensor
                if len(pending[key]) < len(order):
                    continue
                parts = pending.pop(key)
                tensor = torch.cat([parts[p] for p in order])
                target = key
            if target not in params:
                raise ModelLoadError(f"the checkpoint's {name} has no place in this encoder")
            params[target].data.copy_(tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {', '.join(missing[:6])}")
        return loaded
