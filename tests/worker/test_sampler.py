"""Sampler: masks, penalties, greedy, seeded reproducibility, the distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker import sampling_ops
from services.worker.sampler import Sampler, compute_token_logprobs, seeded_key
from services.worker.sampling_ops import apply_min_p, apply_penalties, apply_top_k_top_p
from services.worker.sampling_table import build_sampling_metadata

NEG_INF = float("-inf")


def metadata(params, vocab_size, prompts=None, outputs=None, eos_token_id=None):
    prompts = prompts or [[0]] * len(params)
    outputs = outputs or [[] for _ in params]
    return build_sampling_metadata(params, prompts, outputs, vocab_size, eos_token_id)


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > NEG_INF).flatten().tolist())


def reference_top_p(probs: list[float], top_p: float) -> set[int]:
    """The smallest set of the most likely tokens whose mass reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in order:
        keep.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return keep


def test_top_k_keeps_exactly_the_k_best_tokens_per_row():
    logits = torch.tensor([[1.0, 5.0, 3.0, 2.0, 4.0], [0.5, -1.0, 2.0, 0.0, 1.0]])
    top_k = torch.tensor([2, 0])  # second row: top-k off
    only_k = apply_top_k_top_p(logits, top_k, None)
    with_p = apply_top_k_top_p(logits, top_k, torch.tensor([1.0, 1.0]))  # the sort path
    for out in (only_k, with_p):
        assert kept(out[0]) == {1, 4}
        assert kept(out[1]) == {0, 1, 2, 3, 4}
        torch.testing.assert_close(out[0, [1, 4]], logits[0, [1, 4]])
        torch.testing.assert_close(out[1], logits[1])


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.7, 0.76, 0.92, 0.999])
def test_top_p_keeps_smallest_set_reaching_the_mass(top_p):
    probs = [0.1, 0.5, 0.15, 0.25]
    logits = torch.tensor([probs]).log()
    out = apply_top_k_top_p(logits, None, torch.tensor([top_p]))
    assert kept(out[0]) == reference_top_p(probs, top_p)
    assert 1 in kept(out[0])  # the top token always survives


def test_top_k_then_top_p_renormalises_over_the_k_kept():
    probs = [0.4, 0.3, 0.2, 0.1]
    logits = torch.tensor([probs]).log()
    # After top-k=2 the kept mass renormalises to [4/7, 3/7]; top_p=0.5 keeps just the top.
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))
    assert kept(out[0]) == {0}
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert kept(out[0]) == {0, 1}


def reference_kept(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """Brute force in float64: top-k, renormalise, then the smallest prefix reaching p."""
    order = logits.double().argsort(descending=True).tolist()
    order = order[:k] if k > 0 else order
    probs = torch.softmax(logits.double()[order], dim=-1).tolist()
    keep, mass = set(), 0.0
    for token, prob in zip(order, probs, strict=True):
        keep.add(token)
        mass += prob
        if mass >= p:
            break
    return keep


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaked: nucleus in the head; flat: full sort
def test_top_k_top_p_mixed_rows_match_brute_force_on_a_large_vocab(scale):
    torch.manual_seed(7)
    vocab_size = 3000  # > TOP_P_CANDIDATES, so p-only rows first try the candidate head
    logits = torch.randn(6, vocab_size) * scale
    top_k = torch.tensor([0, 0, 40, 2000, 7, 0])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.3, 1.0])
    out = apply_top_k_top_p(logits, top_k, top_p)
    for row in range(6):
        want = reference_kept(logits[row], int(top_k[row]), float(top_p[row]))
        assert kept(out[row]) == want
        torch.testing.assert_close(out[row, sorted(want)], logits[row, sorted(want)])
    assert kept(out[5]) == set(range(vocab_size))
    assert vocab_size > sampling_ops.TOP_P_CANDIDATES


def test_min_p_drops_tokens_below_fraction_of_top_probability():
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1], [0.25, 0.25, 0.25, 0.25]]).log()
    out = apply_min_p(logits, torch.tensor([0.4, 0.9]))
    assert kept(out[0]) == {0, 1}  # threshold 0.2
    assert kept(out[1]) == {0, 1, 2, 3}


def reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    for v in range(logits.shape[0]):
        value = out[v].item()
        if v in prompt or v in output:
            value = value / rep if value > 0 else value * rep
        count = output.count(v)
        value -= freq * count + pres * (count > 0)
        out[v] = value
    return out


def test_penalties_match_their_formulas():
    torch.manual_seed(0)
    vocab_size = 12
    logits = torch.randn(3, vocab_size) * 3
    prompts = [[1, 2, 2, 3], [4], [0, 11]]
    outputs = [[3, 5, 5, 5, 7], [], [11, 6, 6]]
    params = [
        SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.9),
        SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0),
        SamplingParams(frequency_penalty=-0.5),
    ]
    md = metadata(params, vocab_size, prompts, outputs)
    assert not md.no_penalties
    got = apply_penalties(
        logits,
        md.prompt_token_ids,
        md.output_token_ids,
        md.repetition_penalty,
        md.frequency_penalty,
        md.presence_penalty,
    )
    for row, p in enumerate(params):
        want = reference_penalties(
            logits[row],
            prompts[row],
            outputs[row],
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
        )
        torch.testing.assert_close(got[row], want)


def test_penalties_steer_greedy_choice_and_leave_input_untouched():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    original = logits.clone()
    md = metadata([SamplingParams(temperature=0.0, presence_penalty=0.5)], 4, outputs=[[0]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]
    torch.testing.assert_close(logits, original)


def test_logit_bias_applies_and_ignores_out_of_vocab_ids():
    logits = torch.zeros(2, 6)
    params = [
        SamplingParams(temperature=0.0, logit_bias={4: 5.0, 1: 2.0, 99: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={2: -3.0}),
    ]
    md = metadata(params, 6)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [4, 0]
    assert md.logit_bias is not None
    bias = md.logit_bias
    columns = (bias.rows.tolist(), bias.token_ids.tolist(), bias.values.tolist())
    triples = sorted(zip(*columns, strict=True))
    assert triples == [(0, 1, 2.0), (0, 4, 5.0), (1, 2, -3.0)]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0]]).repeat(4, 1)
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]),  # 1 output: masked
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2]),  # 2 outputs: free
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[2], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=1),  # eos only
    ]
    outputs = [[1], [1, 1], [], []]
    md = metadata(params, 5, outputs=outputs, eos_token_id=eos)
    sampled = Sampler()(logits, md).sampled_token_ids.tolist()
    assert sampled == [4, 2, 3, 2]


def test_greedy_rows_take_exact_argmax_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(64, 1000)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=5) for i in range(64)]
    out = Sampler(seed=0)(logits, metadata(params, 1000))
    greedy = torch.arange(64) % 2 == 1
    assert torch.equal(out.sampled_token_ids[greedy], logits[greedy].argmax(dim=-1))
    # random rows obey their top_k = 5
    top5 = logits.topk(5, dim=-1).indices
    assert (top5[~greedy] == out.sampled_token_ids[~greedy, None]).any(dim=1).all()


def test_seeded_rows_reproducible_and_independent_of_the_batch():
    torch.manual_seed(2)
    vocab_size = 50
    target = torch.randn(vocab_size)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def sample(extra_rows: int, position: int, row: int, sampler: Sampler) -> int:
        params = [SamplingParams(temperature=1.3) for _ in range(extra_rows)]
        params.insert(row, seeded)
        logits = torch.randn(extra_rows + 1, vocab_size)
        logits[row] = target
        outputs = [[] for _ in params]
        outputs[row] = [0] * position
        md = metadata(params, vocab_size, outputs=outputs)
        return sampler(logits, md).sampled_token_ids[row].item()

    first = [sample(0, pos, 0, Sampler()) for pos in range(8)]
    # Another batch composition, another row, a fresh sampler (as after a preemption).
    again = [sample(5, pos, 3, Sampler(seed=99)) for pos in range(8)]
    assert first == again
    assert len(set(first)) > 1  # the position moves the noise
    assert seeded_key(1234, 0) != seeded_key(1234, 1) != seeded_key(1235, 0)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax_distribution(seeded):
    num_draws, temperature = 10_000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2])
    seed = (lambda i: i) if seeded else (lambda i: None)
    params = [SamplingParams(temperature=temperature, seed=seed(i)) for i in range(num_draws)]
    md = metadata(params, 5)
    tokens = Sampler(seed=0)(logits.repeat(num_draws, 1), md).sampled_token_ids
    probs = torch.softmax(logits / temperature, dim=-1)
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001.
    assert chi_square(tokens, probs) < 18.47


def test_top_p_sampling_never_leaves_the_nucleus():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0]]).repeat(2000, 1)
    md = metadata([SamplingParams(top_p=0.8, min_p=0.05)] * 2000, 5)
    tokens = Sampler(seed=3)(logits, md).sampled_token_ids
    probs = torch.softmax(logits[0], dim=-1).tolist()
    assert set(tokens.tolist()) == reference_top_p(probs, 0.8)


def reference_rank(logprobs: torch.Tensor, token: int) -> int:
    return int((logprobs > logprobs[token]).sum()) + 1


def test_logprobs_are_raw_log_softmax_with_ranks():
    torch.manual_seed(4)
    logits = torch.randn(6, 40)
    params = [
        SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=2.0, top_k=4)
        for _ in range(6)
    ]
    out = Sampler(seed=5)(logits, metadata(params, 40, prompts=[[1, 2, 3]] * 6))
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (6, 4)
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    for row in range(6):
        ids = lp.token_ids[row].tolist()
        torch.testing.assert_close(lp.logprobs[row], raw[row, ids])
        assert ids[1:] == raw[row].topk(3).indices.tolist()
        assert lp.ranks[row].tolist() == [reference_rank(raw[row], t) for t in ids]


def test_compute_token_logprobs_for_prompt_targets():
    torch.manual_seed(6)
    logits = torch.randn(5, 30)
    targets = torch.tensor([0, 7, 29, 3, 3])
    out = compute_token_logprobs(logits, targets, 0)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids.shape == (5, 1)
    torch.testing.assert_close(out.logprobs[:, 0], raw[torch.arange(5), targets])
    assert out.ranks[:, 0].tolist() == [
        reference_rank(raw[i], t) for i, t in enumerate(targets.tolist())
    ]
    top = compute_token_logprobs(logits, targets, 2)
    assert torch.equal(top.token_ids[:, 1:], raw.topk(2).indices)
    assert top.ranks[:, 1:].tolist() == [[1, 2]] * 5
    assert math.isclose(float(top.logprobs[0, 1]), float(raw[0].max()), rel_tol=1e-6)
