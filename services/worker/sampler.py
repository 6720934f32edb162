"""Sampler: logits [B, V] -> one token per row, vectorised across the batch, vLLM's order.

Seeded rows draw their noise from a generator seeded from (seed, output position), so a
token depends only on the row's own logits and state: not on the other rows in the batch,
and not on whether the request was preempted and recomputed. Logprobs are the raw
log_softmax of the model's logits, before any processing (vLLM's "raw_logprobs").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sampling_metadata import SamplingMetadata
from services.worker.sampling_ops import (
    apply_grammar_mask,
    apply_logits_processors,
    apply_min_p,
    apply_top_k_top_p,
    revive_dead_rows,
)

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class LogprobsTensors:
    """Per row: the chosen token first, then the top-k tokens."""

    token_ids: torch.Tensor  # [N, k+1] int64
    logprobs: torch.Tensor  # [N, k+1] float32
    ranks: torch.Tensor  # [N, k+1] int64, 1-based rank in the full distribution


@dataclass(frozen=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # k = metadata.max_num_logprobs


class Sampler:
    """Stateless apart from the generators; one per worker. The steps, in vLLM's order:

    0. structured outputs: tokens the row's grammar does not allow get -inf (so logprobs,
       penalties and every later step see the masked logits, as in vLLM)
    1. logit_bias, min_tokens mask (EOS and stop ids banned until min_tokens outputs)
    2. repetition penalty (over prompt + output), frequency and presence penalties (output)
    3. greedy rows: exact argmax of the processed logits
    4. random rows: temperature, min_p, top-k, top-p, then the exponential race
       argmax(probs / Exp(1)), which is a draw from probs.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._seeded: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # [B, V]
        if md.grammar is not None:  # before anything else sees the logits (as vLLM)
            logits = apply_grammar_mask(logits, md.grammar)
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
        masked = logits
        logits = apply_logits_processors(logits, md)
        if md.grammar is not None:
            logits = revive_dead_rows(logits, masked)
        sampled = self._sample(logits, md)  # [B]
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy_ids = None
        if not md.all_random:
            greedy_ids = logits.argmax(dim=-1)  # [B]
            if md.all_greedy:
                return greedy_ids
        is_greedy = md.temperature < _GREEDY_EPS  # [B]
        temperature = torch.where(is_greedy, 1.0, md.temperature)
        logits = logits / temperature.unsqueeze(1)
        if not md.no_min_p:
            logits = apply_min_p(logits, md.min_p)
        if not (md.no_top_k and md.no_top_p):
            logits = apply_top_k_top_p(
                logits, None if md.no_top_k else md.top_k, None if md.no_top_p else md.top_p
            )
        probs = torch.softmax(logits, dim=-1)  # [B, V]
        noise = self._exponential_noise(probs, md)  # [B, V]
        random_ids = probs.div_(noise).argmax(dim=-1)  # [B]
        if greedy_ids is None:
            return random_ids
        return torch.where(is_greedy, greedy_ids, random_ids)

    def _exponential_noise(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        device = probs.device
        uniform = torch.empty_like(probs)  # [B, V]
        seeded_rows = [row for row, seed in enumerate(md.seeds) if seed is not None]
        if len(seeded_rows) < len(md.seeds):
            uniform.uniform_(generator=self._shared_generator(device))
        if seeded_rows:
            generator = self._seeded.get(device)
            if generator is None:
                generator = self._seeded[device] = torch.Generator(device=device)
            for row in seeded_rows:
                generator.manual_seed(seeded_key(md.seeds[row], md.output_positions[row]))
                uniform[row].uniform_(generator=generator)
        # Exp(1) by inversion, -log(1 - U) (cheaper on CPU than exponential_). It can
        # be 0, which would turn a masked token's 0 / 0 into NaN: clamp to the tiniest float.
        noise = uniform.neg_().log1p_().neg_()  # [B, V]
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._shared[device] = generator
        return generator


def seeded_key(seed: int, output_position: int) -> int:
    """A 63-bit generator seed from (request seed, output position), well mixed."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_position) >> 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def gather_logprobs(
    logprobs: torch.Tensor,  # [N, V] log_softmax
    token_ids: torch.Tensor,  # [N] int64
    num_logprobs: int,
) -> LogprobsTensors:
    """The chosen token's logprob and rank, then the top num_logprobs tokens."""
    token_ids = token_ids.long().unsqueeze(1)  # [N, 1]
    token_logprobs = logprobs.gather(1, token_ids)  # [N, 1]
    token_ranks = (logprobs > token_logprobs).sum(dim=-1, keepdim=True) + 1  # [N, 1]
    if num_logprobs == 0:
        return LogprobsTensors(token_ids, token_logprobs, token_ranks)
    top = logprobs.topk(num_logprobs, dim=-1)  # [N, k]
    top_ranks = torch.arange(1, num_logprobs + 1, device=logprobs.device)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top.indices], dim=1),
        logprobs=torch.cat([token_logprobs, top.values], dim=1),
        ranks=torch.cat([token_ranks, top_ranks.expand(token_ids.shape[0], -1)], dim=1),
    )


def compute_token_logprobs(
    logits: torch.Tensor,  # [N, V] raw model logits
    target_ids: torch.Tensor,  # [N] int64
    num_logprobs: int,
) -> LogprobsTensors:
    """Logprobs of given target tokens (prompt logprobs) plus the top num_logprobs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    return gather_logprobs(logprobs, target_ids, num_logprobs)
