"""A hand-built paged batch that drives a model as the scheduler and InputBatch would: it
hands out blocks (shuffled, so tables are non-contiguous), builds block tables and slot
mappings, and runs one step at a time."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from pagestream_kernels.attention_metadata import AttentionMetadata


@dataclass
class SeqState:
    """A request as the test sees it: its full token ids and its cache blocks."""

    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


class PagedSession:
    """A KV cache plus the per-step tensors a model runner would build (the test's InputBatch)."""

    def __init__(self, model, num_blocks: int = 48, block_size: int = 4, seed: int = 0):
        spec = model.kv_cache_spec
        self.model = model
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(spec.layer_shape(num_blocks, block_size), dtype=spec.dtype)
            for _ in range(spec.num_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous tables on purpose

    def fork_prefix(self, source: SeqState, token_ids: list[int], num_blocks: int) -> SeqState:
        """A new sequence whose first `num_blocks` full blocks are `source`'s (a prefix hit)."""
        shared = num_blocks * self.block_size
        assert token_ids[:shared] == source.token_ids[:shared]
        return SeqState(token_ids, list(source.block_ids[:num_blocks]), shared)

    def _ensure_blocks(self, seq: SeqState, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            seq.block_ids.append(self.free_blocks.pop())

    def build_step(
        self, rows: list[tuple[SeqState, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq, num_new in rows:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            self._ensure_blocks(seq, end)
            input_ids += seq.token_ids[start:end]
            positions += list(range(start, end))
            slots += [
                seq.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
        width = max(len(seq.block_ids) for seq, _ in rows)
        table = [seq.block_ids + [0] * (width - len(seq.block_ids)) for seq, _ in rows]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_table=torch.tensor(table, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(n for _, n in rows),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(input_ids), torch.tensor(positions), metadata

    def step(self, rows: list[tuple[SeqState, int]]) -> list[torch.Tensor]:
        """Run one forward over `rows` ((sequence, num_new_tokens) each); returns each
        sequence's logits for its new tokens ([num_new, vocab] float32)."""
        input_ids, positions, metadata = self.build_step(rows)
        with torch.no_grad():
            hidden = self.model(input_ids, positions, self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden)
        out = []
        for i, (seq, num_new) in enumerate(rows):
            start = int(metadata.query_start_loc[i])
            out.append(logits[start : start + num_new])
            seq.num_computed_tokens += num_new
        return out
