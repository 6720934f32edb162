"""Per-step attention metadata: where this step's tokens live in the paged KV cache.

The worker's model runner builds one `AttentionMetadata` per forward pass from the
InputBatch's tensors of the same names; every attention layer of the model reads it
unchanged, and every paged-attention kernel (pagestream_kernels.reference, pagestream_kernels.cpu,
pagestream_kernels.triton) takes it as its one description of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """The flattened batch's layout, shared by every layer of one forward pass.

    slot_mapping:    [num_tokens] int64, cache slot (block_id * block_size + offset) of each
                     scheduled token; a negative slot means "do not write" (padding).
    block_table:     [num_seqs, max_num_blocks] int32, the physical blocks of each sequence.
    seq_lens:        [num_seqs] int32, context length of each sequence including this step's
                     tokens (num_computed_tokens + num_scheduled_tokens).
    query_start_loc: [num_seqs + 1] int32, prefix sums of num_scheduled_tokens.
    max_query_len:   host int, the largest num_scheduled_tokens in the batch.
    max_seq_len:     host int, the largest seq_len in the batch.
    groups:          with KV cache groups (layers sharing one block table, a hybrid
                     model's), every group's metadata, this one (group 0's) first; each
                     layer reads its own group's (`group(g)`). Empty: one group.
    key_limits:      None (causal) or [num_tokens] int32, the keys each row sees: its
                     position + 1, or more for the tokens of an image a model attends to
                     both ways (Gemma 3's: up to the image's last token), never past its
                     sequence's seq_len (keys not written yet). A sliding window still
                     starts from the row's own position.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    groups: tuple[AttentionMetadata, ...] = ()
    key_limits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        num_seqs = self.seq_lens.shape[0]
        if self.query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(
                f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                f"got {self.query_start_loc.shape[0]}."
            )
        if self.block_table.dim() != 2 or self.block_table.shape[0] != num_seqs:
            raise ValueError(
                f"block_table must be [num_seqs={num_seqs}, max_num_blocks], "
                f"got {tuple(self.block_table.shape)}."
            )
        if self.key_limits is not None and self.key_limits.shape != self.slot_mapping.shape:
            raise ValueError(
                f"key_limits must be [num_tokens={self.slot_mapping.shape[0]}], "
                f"got {tuple(self.key_limits.shape)}."
            )

    @classmethod
    def cached(
        cls, block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
    ) -> AttentionMetadata:
        """A batch whose K/V are in the cache already (nothing to write: every slot is -1),
        its max lengths read from the tensors (a sync on CUDA): for kernel tests and
        benchmarks that fill the cache themselves."""
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        num_tokens = int(query_start_loc[-1]) if query_start_loc.numel() else 0
        return cls(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=seq_lens.device),
            block_table=block_table,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=int(q_lens.max()) if q_lens.numel() else 0,
            max_seq_len=int(seq_lens.max()) if seq_lens.numel() else 0,
        )

    def group(self, index: int) -> AttentionMetadata:
        """The metadata of KV cache group `index` (this one when there is one group)."""
        return self.groups[index] if self.groups else self

    @property
    def num_groups(self) -> int:
        return len(self.groups) or 1

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
