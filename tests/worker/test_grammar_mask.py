"""The worker's half of structured outputs: packed bitmasks unpack to exactly the allowed
tokens, masked rows keep only those (rows without a grammar are bit-for-bit unchanged),
and a row left with nothing (min_tokens banning the grammar's only token, EOS) falls back
to the grammar's tokens instead of becoming NaN."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import GrammarMask
from services.worker.sampling_ops import apply_grammar_mask, banned_from_bitmask
from services.worker.sampling_table import build_sampling_metadata

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def _words(allowed: list[set[int]]) -> np.ndarray:
    """int32 words, bit t % 32 of word t // 32 = token t (as the scheduler sends them)."""
    words = np.zeros((len(allowed), (VOCAB + 31) // 32), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def _mask(rows: list[int], allowed: list[set[int]], width: int = VOCAB) -> GrammarMask:
    banned = torch.from_numpy(banned_from_bitmask(_words(allowed), width).copy())
    return GrammarMask(rows=torch.tensor(rows), banned=banned)


def test_unpacking_bans_exactly_the_tokens_not_allowed():
    allowed = [{0, 31, 32, 63, 64, 69}, set(), set(range(VOCAB))]
    banned = banned_from_bitmask(_words(allowed), VOCAB)
    assert banned.shape == (3, VOCAB) and banned.dtype == bool
    for row, tokens in enumerate(allowed):
        assert set(np.nonzero(~banned[row])[0].tolist()) == tokens


def test_masking_touches_only_the_constrained_rows():
    logits = torch.randn(3, VOCAB)
    out = apply_grammar_mask(logits.clone(), _mask([1], [{5, 40}]))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert finite == [5, 40] and torch.equal(out[1, [5, 40]], logits[1, [5, 40]])


def test_the_sampler_only_picks_allowed_tokens_even_against_a_huge_bias():
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={7: 100.0}) for s in range(4)]
    md = build_sampling_metadata(params, [[1, 2]] * 4, [[]] * 4, VOCAB)
    md = dataclasses.replace(md, grammar=_mask([0, 1, 2, 3], [{3, 9, 68}] * 4))
    out = Sampler(seed=0)(torch.randn(4, VOCAB), md)
    assert set(out.sampled_token_ids.tolist()) <= {3, 9, 68}


def test_a_row_left_with_nothing_falls_back_to_the_grammar_tokens_not_nan():
    eos = 2
    params = [SamplingParams(temperature=1.0, seed=1, min_tokens=5), SamplingParams(temperature=0)]
    md = build_sampling_metadata(params, [[1, 4], [1, 4]], [[], []], VOCAB, eos_token_id=eos)
    md = dataclasses.replace(md, grammar=_mask([0], [{eos}]))
    logits = torch.randn(2, VOCAB)
    out = Sampler(seed=0)(logits, md)
    assert out.sampled_token_ids.tolist() == [eos, int(logits[1].argmax())]


def test_logits_wider_than_the_vocabulary_ban_the_extra_columns():
    logits = torch.zeros(2, VOCAB + 10)
    out = apply_grammar_mask(logits, _mask([0, 1], [{1}, {2, 69}]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [2, 69]
