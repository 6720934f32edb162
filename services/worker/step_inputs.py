"""StepInputs: one step's flattened varlen batch (no padding), and the numpy that builds it.

Request i with num_computed_tokens c and num_scheduled_tokens n feeds token_ids[c:c+n]
at positions c..c+n-1; seq_len = c + n; each KV cache group g has its own table and
slots: slot = table[g][pos // block_size] * block_size + pos % block_size. It samples iff
c + n == its number of known tokens, which counts the speculative proposals it verifies
this step (written after its token ids): verifying k, it samples its last k + 1 positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pagestream_kernels.attention_metadata import AttentionMetadata
from services.worker.multimodal.image_slice import ImageSlice
from services.worker.pooling_state import PoolingState
from services.worker.sampling_metadata import SamplingMetadata


@dataclass(frozen=True)
class PromptLogprobsInputs:
    """Flat rows whose logits score prompt tokens, grouped per request in row order."""

    request_ids: list[str]
    num_rows: list[int]  # per request: how many of the rows below are its own
    # per request: prompt position of its first target token (1 = the first scored
    # token, whose predecessor, position 0, has no logprob and is reported as None)
    first_positions: list[int]
    num_logprobs: list[int]  # per request: sampling_params.prompt_logprobs
    token_indices: torch.Tensor  # [Np] int64 flat token rows of the batch
    target_ids: torch.Tensor  # [Np] int64 the prompt token each row predicts

    @property
    def max_num_logprobs(self) -> int:
        return max(self.num_logprobs)


@dataclass(frozen=True)
class PoolingInputs:
    """The rows of this step's pooling requests: request i owns flat rows
    row_starts[i]..row_ends[i]-1, prompt positions first_positions[i] on, and its pooled
    state so far (kept in the InputBatch between steps)."""

    request_ids: list[str]
    row_starts: list[int]
    row_ends: list[int]
    first_positions: list[int]
    num_prompt_tokens: list[int]
    states: list[PoolingState]


@dataclass(frozen=True)
class StepInputs:
    """All tensors live on the worker's device; *_host values are plain ints."""

    request_ids: list[str]  # scheduled requests, in row order
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 (an M-RoPE model's: [3, T])
    slot_mapping: torch.Tensor  # [G, T] int64, per KV cache group
    query_start_loc: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [G, S, max_blocks] int32 (columns past a row's table are 0)
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: list[int]  # [S+1]
    seq_lens_host: list[int]  # [S]
    # [L] int64 flat rows whose logits are sampled: each sampling request's last token, or
    # its last k + 1 when it verifies k proposals (L = R + the proposals verified)
    logits_indices: torch.Tensor
    sampling_request_ids: list[str]  # [R]
    sampling_metadata: SamplingMetadata | None  # [L] rows; None when no request samples
    # request_id -> the proposals it verifies (only requests that have some)
    draft_token_ids: dict[str, list[int]]
    prompt_logprobs: PromptLogprobsInputs | None
    pooling: PoolingInputs | None = None
    # the rows that take image embeddings instead of their tokens' (vision-language models)
    images: list[ImageSlice] = dataclasses.field(default_factory=list)
    # [T] int32 each row's key limit when the model's image tokens attend both ways
    # (multimodal/image_key_limits.py); None: every row causal
    key_limits: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]

    def attention_metadata(self) -> AttentionMetadata:
        """Group 0's metadata, with every group's when there are several."""
        groups = [self._group_metadata(g) for g in range(self.slot_mapping.shape[0])]
        if len(groups) == 1:
            return groups[0]
        return dataclasses.replace(groups[0], groups=tuple(groups))

    def _group_metadata(self, group: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[group],
            block_table=self.block_table[group],
            seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            key_limits=self.key_limits,
        )


@dataclass(frozen=True)
class FlatBatch:
    """Host (numpy) form of the flattened batch."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [G, T] int64
    query_start_loc: np.ndarray  # [S+1] int32
    seq_lens: np.ndarray  # [S] int32
    block_table: np.ndarray  # [G, S, max_blocks] int32
    samples: np.ndarray  # [S] bool: the request has caught up and samples
    logits_indices: np.ndarray  # [S] int64 flat row of each request's last scheduled token


def flatten_batch(
    token_ids: np.ndarray,  # [capacity, max_model_len] every slot's prompt + output ids
    block_tables: np.ndarray,  # [G, capacity, max_positions] int32, per KV cache group
    num_positions: np.ndarray,  # [capacity] int64 block positions in each slot's tables
    slots: np.ndarray,  # [S] int64 the scheduled requests' slots, in row order
    num_known: np.ndarray,  # [S] int64 known tokens of each (proposals included)
    num_computed: np.ndarray,  # [S] int64
    num_scheduled: np.ndarray,  # [S] int64, each >= 1
    block_size: int,
) -> FlatBatch:
    query_start_loc = np.zeros(len(slots) + 1, np.int64)  # [S+1]
    np.cumsum(num_scheduled, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    row_of_token = np.repeat(np.arange(len(slots)), num_scheduled)  # [T]
    slot_of_token = slots[row_of_token]  # [T]
    offsets = np.arange(total, dtype=np.int64) - query_start_loc[row_of_token]  # [T]
    positions = num_computed[row_of_token] + offsets  # [T]
    blocks = block_tables[:, slot_of_token, positions // block_size].astype(np.int64)  # [G, T]
    seq_lens = num_computed + num_scheduled  # [S]
    width = int(num_positions[slots].max(initial=0))
    return FlatBatch(
        input_ids=token_ids[slot_of_token, positions].astype(np.int64),
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        query_start_loc=query_start_loc.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_table=block_tables[:, slots, :width],  # [G, S, width]
        samples=seq_lens == num_known,
        logits_indices=query_start_loc[1:] - 1,
    )


def schedule_problem(
    num_computed: np.ndarray,  # [S] int64
    num_scheduled: np.ndarray,  # [S] int64
    num_tokens: np.ndarray,  # [S] int64 known tokens
    num_slots: np.ndarray,  # [S] int64 KV slots in each block table
) -> tuple[int, str] | None:
    """What the worker's state cannot run of a schedule, as (row, message); None when it
    is fine. (A schedule's own shape, counts >= 1 and their total, is the plan's: the
    scheduler builds it so, the decoder checks it.)"""
    seq_lens = num_computed + num_scheduled  # [S]
    checks = (
        (seq_lens > num_tokens, "schedules tokens past its known token ids"),
        (seq_lens > num_slots, "schedules tokens past the end of its block table"),
    )
    for bad, message in checks:
        if bad.any():
            row = int(np.argmax(bad))
            counts = f"num_computed_tokens {num_computed[row]}, num_scheduled_tokens"
            return row, f"{message} ({counts} {num_scheduled[row]})"
    return None
