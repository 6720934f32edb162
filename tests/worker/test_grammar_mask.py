"""The worker's half of structured outputs: packed bitmasks unpack to exactly the allowed
tokens, masked rows keep only those (rows without a grammar are bit-for-bit unchanged),
and a row left with nothing (min_tokens banning the grammar's only token, EOS) falls back
to the grammar's tokens instead of becoming NaN."""

from __future__ import annotations

import dataclasses

import torch

from services.common.sampling_params import SamplingParams
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import GrammarMask
from services.worker.sampling_ops import apply_grammar_mask, unpack_bitmask
from services.worker.sampling_table import build_sampling_metadata

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def _packed(allowed: list[set[int]]) -> torch.Tensor:
    """int32 words, bit t % 32 of word t // 32 = token t (as the scheduler sends them)."""
    import numpy as np

    words = np.zeros((len(allowed), (VOCAB + 31) // 32), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32).copy())


def test_unpack_gives_exactly_the_allowed_tokens():
    allowed = [{0, 31, 32, 63, 64, 69}, set(), set(range(VOCAB))]
    unpacked = unpack_bitmask(_packed(allowed), VOCAB)
    assert unpacked.shape == (3, VOCAB)
    for row, tokens in enumerate(allowed):
        assert set(torch.nonzero(unpacked[row]).flatten().tolist()) == tokens


def test_masking_touches_only_the_constrained_rows():
    logits = torch.randn(3, VOCAB)
    mask = GrammarMask(rows=torch.tensor([1]), bitmask=_packed([{5, 40}]))
    out = apply_grammar_mask(logits, mask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    finite = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert finite == [5, 40] and torch.equal(out[1, [5, 40]], logits[1, [5, 40]])


def test_the_sampler_only_picks_allowed_tokens_even_against_a_huge_bias():
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={7: 100.0}) for s in range(4)]
    md = build_sampling_metadata(params, [[1, 2]] * 4, [[]] * 4, VOCAB)
    md = dataclasses.replace(
        md, grammar=GrammarMask(rows=torch.arange(4), bitmask=_packed([{3, 9, 68}] * 4))
    )
    out = Sampler(seed=0)(torch.randn(4, VOCAB), md)
    assert set(out.sampled_token_ids.tolist()) <= {3, 9, 68}


def test_a_row_left_with_nothing_falls_back_to_the_grammar_tokens_not_nan():
    eos = 2
    params = [SamplingParams(temperature=1.0, seed=1, min_tokens=5), SamplingParams(temperature=0)]
    md = build_sampling_metadata(params, [[1, 4], [1, 4]], [[], []], VOCAB, eos_token_id=eos)
    md = dataclasses.replace(
        md, grammar=GrammarMask(rows=torch.tensor([0]), bitmask=_packed([{eos}]))
    )
    logits = torch.randn(2, VOCAB)
    out = Sampler(seed=0)(logits, md)
    assert out.sampled_token_ids.tolist() == [eos, int(logits[1].argmax())]
