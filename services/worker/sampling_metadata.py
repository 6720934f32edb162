"""SamplingMetadata: the per-row sampling inputs for the rows that sample this step.

Row b of every tensor belongs to row b of the logits handed to the Sampler. Dense
parameters are [B] tensors; rare per-request extras (logit bias, the min_tokens mask)
are sparse (row, token) index tensors so the common case costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitBias:
    """Additive biases: logits[rows[i], token_ids[i]] += values[i]."""

    rows: torch.Tensor  # [K] int64
    token_ids: torch.Tensor  # [K] int64
    values: torch.Tensor  # [K] float32


@dataclass(frozen=True)
class TokenMask:
    """Banned tokens: logits[rows[i], token_ids[i]] = -inf."""

    rows: torch.Tensor  # [K] int64
    token_ids: torch.Tensor  # [K] int64


@dataclass(frozen=True)
class GrammarMask:
    """Structured outputs: banned[i] marks the tokens rows[i]'s grammar does not allow."""

    rows: torch.Tensor  # [G] int64, ascending
    banned: torch.Tensor  # [G, V] bool


@dataclass(frozen=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; < 1e-5 means greedy
    top_p: torch.Tensor  # [B] float32; 1.0 = off
    top_k: torch.Tensor  # [B] int64; 0 = off
    min_p: torch.Tensor  # [B] float32; 0.0 = off
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32; 1.0 = off
    # Token ids for the penalties, right-padded with vocab_size (an out-of-range id that
    # bincount-style counting drops); None when no row has a penalty.
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64
    output_token_ids: torch.Tensor | None  # [B, max_output_len] int64
    logit_bias: LogitBias | None
    # EOS and stop_token_ids of the rows that have not reached min_tokens yet.
    min_tokens_mask: TokenMask | None
    seeds: tuple[int | None, ...]  # per row; None = the sampler's shared generator
    output_positions: tuple[int, ...]  # per row: number of output tokens so far
    num_logprobs: tuple[int | None, ...]  # per row: sampling_params.logprobs
    max_num_logprobs: int | None  # None = no row wants logprobs
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    no_penalties: bool
    grammar: GrammarMask | None = None  # rows constrained by a grammar this step

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]
