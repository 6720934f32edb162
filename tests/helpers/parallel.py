"""Shared by the tensor/pipeline-parallel tests: workloads and a greedy comparison that
tells a real divergence from a near-tie of the reference's logits."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pagestream import SamplingParams

# Two logits closer than this may swap places under a different summation order (a
# row-split matmul summed by an all-reduce): a divergence there is not a bug.
NEAR_TIE = 1e-4

_HF_MODELS: dict[Path, torch.nn.Module] = {}


def mixed_prompts(count: int, seed: int, vocab: int = 500) -> list[list[int]]:
    """Mixed lengths; a third share one long prefix, a third another, the rest are fresh."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 23)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))]
        prompts.append(shared[i % 3] + tail if i % 3 < 2 else tail + [7] * (i % 5))
    return prompts


def greedy_params(count: int, max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens + i % 4) for i in range(count)]


def generate_ids(llm, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def set_preemption_mode(llm, mode: str) -> None:
    """The workers do not depend on the mode (swaps are block moves they always run), so
    one worker group serves both modes: only the scheduler's config changes."""
    scheduler = llm.engine.scheduler
    scheduler.config = replace(scheduler.config, preemption_mode=mode)


def _hf_model(folder: Path) -> torch.nn.Module:
    if folder not in _HF_MODELS:
        _HF_MODELS[folder] = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _HF_MODELS[folder]


def top2_gap(folder: Path, token_ids: list[int]) -> float:
    """HF float32: the gap between the two largest next-token logits after token_ids."""
    with torch.no_grad():
        logits = _hf_model(folder)(input_ids=torch.tensor([token_ids])).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def assert_same_or_near_tie(
    folder: Path, prompt: list[int], got: list[int], expected: list[int]
) -> None:
    """got == expected, or they first differ where the reference's top two logits tie
    within NEAR_TIE (then the rest is not comparable)."""
    if got == expected:
        return
    k = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    assert k is not None, f"lengths differ: {got} vs {expected}"
    gap = top2_gap(folder, prompt + expected[:k])
    assert gap < NEAR_TIE, (
        f"greedy outputs diverge at step {k} where the reference's top-2 logit gap is "
        f"{gap:.2e} (not a tie): got {got}, expected {expected}"
    )
