"""Encoder: what every bidirectional encoder of the pooling runner shares (BERT's family,
ModernBERT, NomicBERT), whatever its layers are.

    hidden = model(input_ids [T], positions [T], kv_caches, attn_metadata)  # [T, hidden]

Attention is bidirectional, so a sequence's rows see its later tokens too: each step must
hold whole prompts (the scheduler schedules an encoder's prompt in one step, never
chunked, never from a prefix hit: `PoolerConfig.whole_prompt`), and nothing is kept in
the paged cache (an encoder never decodes): the step's own keys and values are all a
query reads. The output is the last hidden state of every row (what sentence-transformers'
Transformer module returns); the Pooler picks and pools rows from it. A classification
checkpoint (`*ForSequenceClassification`: a reranker or a classifier) runs its head over
the pooled row (`pooled_head`).

A subclass builds its layers, runs them in `encode` and names the checkpoint's tensors as
its own in `checkpoint_name` (a parameter, or a (parameter, part) of one fused from several
tensors, joined in the order `fused` gives for the parameter's module name).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
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
) -> torch.Tensor:
    """Each sequence's rows attend to all of its rows (no causal mask; a bias [H | 1, n, n]
    adds to a sequence's scores: a relative position bias, or -inf outside a window)."""
    out = torch.empty_like(q)
    for i, (begin, end) in enumerate(itertools.pairwise(starts)):
        qs, ks, vs = (t[begin:end].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        bias = None if biases is None else biases[i]
        attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias)
        out[begin:end] = attended.transpose(0, 1)
    return out


def window_mask(n: int, half_window: int, device: torch.device) -> torch.Tensor | None:
    """[1, n, n] bool: key j is seen from query i when |i - j| <= half_window (None: every
    key is, the sequence being no longer than the window)."""
    if n <= half_window + 1:
        return None
    positions = torch.arange(n, device=device)
    return ((positions[:, None] - positions[None, :]).abs() <= half_window)[None]


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
        self.max_seq_length: int | None = None  # sentence_bert_config.json's, if any
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

    def use_native_step(self) -> bool:
        return False  # the torch path: no native CPU step for encoders yet

    @property
    def max_positions(self) -> int:
        """The longest sequence its positions cover."""
        return int(self.config.max_position_embeddings)

    @property
    def max_model_len(self) -> int | None:
        """Its positions, or the shorter max_seq_length its sentence-transformers folder
        was trained to (set by the loader; a longer prompt is refused by name, or cut with
        truncate_prompt_tokens, rather than read past what the model was trained on)."""
        return min(self.max_positions, self.max_seq_length or self.max_positions)

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
