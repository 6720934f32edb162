"""Pure tensor ops of the Sampler: logit bias, token masks, penalties, min-p, top-k/top-p.

Each takes logits [B, V] and per-row parameters and returns new logits; none modifies
its input. Masked tokens become -inf.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.scheduler_output import SchedulerOutput
from services.worker.sampling_metadata import GrammarMask, LogitBias, SamplingMetadata, TokenMask

NEG_INF = float("-inf")
# Rows with top_p but no top_k first look for their nucleus among this many best tokens
# (a top-k is far cheaper than a full sort); a full sort only when it is not in there.
TOP_P_CANDIDATES = 1024


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Logit bias, the min_tokens mask, then the penalties (vLLM's order)."""
    if md.logit_bias is not None:
        logits = apply_logit_bias(logits, md.logit_bias)
    if md.min_tokens_mask is not None:
        logits = apply_token_mask(logits, md.min_tokens_mask)
    if not md.no_penalties:
        assert md.prompt_token_ids is not None and md.output_token_ids is not None
        logits = apply_penalties(
            logits,
            md.prompt_token_ids,
            md.output_token_ids,
            md.repetition_penalty,
            md.frequency_penalty,
            md.presence_penalty,
        )
    return logits


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask) -> torch.Tensor:
    """-inf for every token a row's grammar does not allow (other rows untouched); in place.
    When every row is constrained it is one masked_fill over the whole batch."""
    banned, width = mask.banned, logits.shape[-1]
    if banned.shape[1] != width:  # logits wider than the vocabulary: the rest is banned
        banned = torch.nn.functional.pad(
            banned[:, :width], (0, max(width - banned.shape[1], 0)), value=True
        )
    if mask.rows.shape[0] == logits.shape[0]:  # rows ascending and complete: 0..B-1
        return logits.masked_fill_(banned, NEG_INF)
    logits[mask.rows] = logits[mask.rows].masked_fill_(banned, NEG_INF)
    return logits


def grammar_mask(
    plan: SchedulerOutput, first_row: dict[str, int], vocab_size: int, device: torch.device
) -> GrammarMask | None:
    """The plan's grammar bitmasks as banned-token masks on the sampling rows they belong
    to (rows ascending); None when no sampling row has a grammar this step. `first_row`:
    each sampling request's first logits row; the i-th bitmask row of a request (one per
    verified position when it verifies proposals) masks its row first_row + i."""
    if not plan.grammar_request_ids:
        return None
    ids = plan.grammar_request_ids
    words = np.frombuffer(plan.grammar_bitmask, dtype="<i4").reshape(len(ids), -1)
    seen: dict[str, int] = {}
    pairs = []
    for i, rid in enumerate(ids):
        if rid in first_row:
            pairs.append((first_row[rid] + seen.get(rid, 0), i))
            seen[rid] = seen.get(rid, 0) + 1
    if not pairs:
        return None
    pairs.sort()
    rows = np.array([row for row, _ in pairs], np.int64)
    banned = banned_from_bitmask(words[[i for _, i in pairs]], vocab_size)
    return GrammarMask(
        rows=torch.from_numpy(rows).to(device), banned=torch.from_numpy(banned).to(device)
    )


def banned_from_bitmask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """[G, W] int32 packed allowed bits (bit t % 32 of word t // 32 = token t, little
    endian) -> [G, V] bool, True where the token is banned."""
    inverted = np.ascontiguousarray(~words.astype("<i4", copy=False))
    bits = np.unpackbits(inverted.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].view(bool)


def revive_dead_rows(logits: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows whose every logit is -inf (a grammar that leaves only EOS while min_tokens bans
    it) take their fallback row (the grammar-masked logits), so nothing becomes NaN."""
    dead = torch.isneginf(logits).all(dim=-1)  # [B]
    if not bool(dead.any()):
        return logits
    # A grammar that allows no token of the vocabulary at all: any token (the scheduler's
    # matcher rejects it and ends the request with an error).
    fallback = torch.where(torch.isneginf(fallback).all(dim=-1, keepdim=True), 0.0, fallback)
    return torch.where(dead.unsqueeze(-1), fallback, logits)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    # [B, V]
    return logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    banned = torch.full(mask.rows.shape, NEG_INF, dtype=logits.dtype, device=logits.device)
    return logits.index_put((mask.rows, mask.token_ids), banned)  # [B, V]


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts per token id: [B, L] ids (padded with vocab_size) -> [B, V] int32."""
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device
    )  # [B, V+1]
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,  # [B, V]
    prompt_token_ids: torch.Tensor,  # [B, Lp] padded with V
    output_token_ids: torch.Tensor,  # [B, Lo] padded with V
    repetition_penalty: torch.Tensor,  # [B]
    frequency_penalty: torch.Tensor,  # [B]
    presence_penalty: torch.Tensor,  # [B]
) -> torch.Tensor:
    """Repetition over prompt + output (HF: positive / p, negative * p), then
    logits -= frequency * count + presence * (count > 0) over the output."""
    vocab_size = logits.shape[1]
    output_counts = token_counts(output_token_ids, vocab_size)  # [B, V]
    output_seen = output_counts > 0  # [B, V]
    seen = (token_counts(prompt_token_ids, vocab_size) > 0) | output_seen  # [B, V]
    penalty = torch.where(seen, repetition_penalty.unsqueeze(1), 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits -= frequency_penalty.unsqueeze(1) * output_counts
    logits -= presence_penalty.unsqueeze(1) * output_seen
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (the top token's probability)."""
    probs = torch.softmax(logits, dim=-1)  # [B, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor | None,  # [B] int64, 0 = off
    top_p: torch.Tensor | None,  # [B] float32, 1.0 = off
) -> torch.Tensor:
    """Keep the k best tokens, then the smallest prefix of them whose renormalised mass
    reaches top_p (the top token always stays). Tokens tied with the last kept one stay."""
    vocab_size = logits.shape[1]
    k = torch.full(logits.shape[:1], vocab_size, device=logits.device)  # [B]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    unrestricted = k >= vocab_size  # [B]
    if top_p is not None:
        unrestricted &= top_p >= 1.0
    width = _head_width(k, top_p, vocab_size)
    if width == 0:
        return logits
    head = _sorted_head(logits, width)  # [B, W] descending
    nucleus = None
    if top_p is not None:
        nucleus = _nucleus_size(logits, head, k, top_p)
        if nucleus is None:  # some nucleus reaches past the head: sort everything
            head = _sorted_head(logits, vocab_size)
            nucleus = _nucleus_size(logits, head, k, top_p)
            assert nucleus is not None
    num_keep = k.clamp(max=head.shape[1])  # [B]
    if top_p is not None:
        num_keep = torch.where(top_p < 1.0, torch.minimum(num_keep, nucleus), num_keep)
    cutoff = head.gather(1, (num_keep - 1).unsqueeze(1))  # [B, 1]
    cutoff.masked_fill_(unrestricted.unsqueeze(1), NEG_INF)
    return logits.masked_fill(logits < cutoff, NEG_INF)


def _head_width(k: torch.Tensor, top_p: torch.Tensor | None, vocab_size: int) -> int:
    """How many of the best tokens cover every row's kept set (0: nothing to mask)."""
    limited = k < vocab_size  # [B]
    width = int(k.masked_fill(~limited, 0).max()) if k.numel() else 0
    if top_p is not None and bool(((~limited) & (top_p < 1.0)).any()):
        width = max(width, TOP_P_CANDIDATES)
    return min(width, vocab_size)


def _sorted_head(logits: torch.Tensor, width: int) -> torch.Tensor:
    if width < logits.shape[1]:
        return logits.topk(width, dim=-1).values  # [B, W]
    return logits.sort(dim=-1, descending=True).values  # [B, V]


def _nucleus_size(
    logits: torch.Tensor,  # [B, V]
    head: torch.Tensor,  # [B, W] the W best logits, descending
    k: torch.Tensor,  # [B] effective top-k, 1..V
    top_p: torch.Tensor,  # [B]
) -> torch.Tensor | None:
    """Per row the smallest prefix of the head whose mass (renormalised over the top-k
    tokens) reaches top_p; None when a row's nucleus may extend past the head."""
    vocab_size, width = logits.shape[1], head.shape[1]
    in_top_k = torch.arange(width, device=head.device) < k.unsqueeze(1)  # [B, W]
    head = head.masked_fill(~in_top_k, NEG_INF)
    log_norm = torch.logsumexp(head, dim=-1)  # [B] exact where k <= W
    whole_row = k > width  # [B] only when k == V (W >= every smaller k)
    if width < vocab_size and bool(whole_row.any()):
        log_norm = torch.where(whole_row, torch.logsumexp(logits, dim=-1), log_norm)
    probs = torch.exp(head - log_norm.unsqueeze(1))  # [B, W]
    cumulative = probs.cumsum(dim=-1)  # [B, W]
    short = whole_row & (top_p < 1.0) & (cumulative[:, -1] < top_p)  # [B]
    if width < vocab_size and bool(short.any()):
        return None
    before = cumulative - probs  # mass of the better tokens, nondecreasing
    return (before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)  # [B]
