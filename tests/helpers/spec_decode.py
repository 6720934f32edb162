"""Shared by the speculative decoding tests that run the whole engine: the two methods'
configs, prompts that copy themselves (so the n-gram matches) mixed with ones that do
not, and the comparison of a speculative run with the plain one (token for token, the
same lengths and finish reasons; a greedy divergence only where the reference's top-2
logits tie within NEAR_TIE)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from tests.helpers.parallel import NEAR_TIE, top2_gap

METHODS = ["ngram", "draft_model"]


def spec_config(method: str, folder: Path | str, k: int = 3, **extra) -> dict:
    """ngram proposing as often as it can, or the target itself as its own draft (so every
    proposal is accepted); `disable_by_batch_size` high enough for the test's batches."""
    extra.setdefault("disable_by_batch_size", 64)
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            **extra,
        }
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": k, **extra}


def copy_heavy_prompts(seed: int, vocab: int = 500) -> list[list[int]]:
    """A block repeated 3 times, a short period repeated, two sharing a long prefix (a
    prefix hit), one given twice, and fresh ones."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    block, period, prefix = fresh(12), fresh(4), fresh(34)
    return [
        block * 3,
        period * 6 + fresh(3),
        prefix + fresh(5),
        prefix + fresh(9),
        fresh(20),
        fresh(7) + block + fresh(5) + block[:6],
        fresh(45),
        block * 3,
    ]


def ids_of(results) -> list[list[tuple[list[int], str | None]]]:
    return [[(list(o.token_ids), o.finish_reason) for o in r.outputs] for r in results]


def assert_same_outputs(reference, speculative, folder: Path | None, prompts=None) -> None:
    """Every completion equal (ids, finish reason). Greedy runs with a `folder` (HF
    weights) and prompts may differ only after a near-tie of the reference's logits."""
    assert len(reference) == len(speculative)
    for i, (ref, spec) in enumerate(zip(reference, speculative, strict=True)):
        assert len(ref.outputs) == len(spec.outputs)
        for a, b in zip(ref.outputs, spec.outputs, strict=True):
            if (list(a.token_ids), a.finish_reason) == (list(b.token_ids), b.finish_reason):
                continue
            assert folder is not None and prompts is not None, (i, a, b)
            expected, got = list(a.token_ids), list(b.token_ids)
            k = next(
                (j for j, (x, y) in enumerate(zip(expected, got, strict=False)) if x != y), None
            )
            assert k is not None, f"prompt {i}: lengths or finish reasons differ: {a} vs {b}"
            gap = top2_gap(folder, list(prompts[i]) + expected[:k])
            assert gap < NEAR_TIE, (
                f"prompt {i}: outputs diverge at step {k}, where the reference's top-2 logit "
                f"gap is {gap:.2e} (not a tie): {got} vs {expected}"
            )


def spec_stats(llm):
    stats = llm.engine.scheduler.get_stats()
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert 0 <= stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert all(a >= b for a, b in itertools.pairwise(per_pos)), per_pos
    return stats


def check_method_stats(llm, method: str) -> None:
    """Speculation really ran: proposals were verified; with the target as its own draft
    every one of them was accepted; the n-gram had both outcomes."""
    stats = spec_stats(llm)
    assert stats.spec_decode_num_draft_tokens > 0, stats
    if method == "draft_model":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens, stats
    else:
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
