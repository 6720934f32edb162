"""Seeded synthetic workloads with ShareGPT-like lognormal lengths; the prompts are windows of
benchmarks/data/corpus.txt in the model's own tokens, each exactly its length.

    workload = make_workload(tokenizer, PROFILES["quick"])
    workload.requests[0].prompt_token_ids, workload.requests[0].output_len
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"


@dataclass(frozen=True)
class Profile:
    """The size of a benchmark run; serving and memory runs scale from it."""

    name: str
    num_requests: int
    seed: int = 0
    prompt_median: int = 256
    prompt_range: tuple[int, int] = (16, 1024)
    output_median: int = 128
    output_range: tuple[int, int] = (16, 512)
    sigma: float = 0.7  # lognormal shape of both lengths
    serve_rates: tuple[float, ...] = (0.5, 1.0, 2.0)  # requests/s for the Poisson arrivals
    serve_num_requests: int = 24  # requests per serving run
    serve_output_scale: float = 0.25  # output lengths of serving runs, scaled down
    hf_batch_sizes: tuple[int, ...] = (8, 16, 32)
    prefix_num_requests: int = 16  # prefix caching: requests sharing one system prompt
    system_prompt_len: int = 512
    question_len: int = 32
    prefix_output_len: int = 32
    sharing_num_prompts: int = 4  # memory sharing: prompts run with n = 4 / beam width 4
    sharing_output_len: int = 64
    parallel_num_requests: int = 16  # `bench parallel`: the first requests, every layout
    parallel_output_scale: float = 0.5  # their output lengths, scaled down
    parallel_rounds: int = 3  # layouts (and async on / off servers) take turns this often

    def notes(self) -> str:
        if self.name == "smoke":
            return "Profile `smoke`: a handful of short requests to check every driver end to end."
        return (
            f"Profile `{self.name}`: {self.num_requests} requests, prompts lognormal around "
            f"{self.prompt_median} tokens in {self.prompt_range[0]}..{self.prompt_range[1]}, "
            f"outputs around {self.output_median} in "
            f"{self.output_range[0]}..{self.output_range[1]}. Its serving runs use the first "
            f"{self.serve_num_requests} requests with outputs scaled by "
            f"{self.serve_output_scale} at rates {', '.join(map(str, self.serve_rates))} "
            "and inf, so that every run stays short on a CPU."
        )

    def __post_init__(self) -> None:
        for name in ("num_requests", "parallel_num_requests", "parallel_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("prompt_range", "output_range"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must satisfy 1 <= low <= high, got {(low, high)}.")


PROFILES: dict[str, Profile] = {
    # The shapes for 64 requests: ~30 minutes on a 2-core CPU, HF's batches included.
    "quick": Profile("quick", num_requests=64, serve_rates=(1.0, 4.0)),
    # A handful of short requests: checks every driver end to end (tests, tiny models).
    "smoke": Profile(
        "smoke",
        num_requests=6,
        prompt_median=24,
        prompt_range=(8, 64),
        output_median=6,
        output_range=(4, 12),
        serve_rates=(4.0,),
        serve_num_requests=4,
        serve_output_scale=1.0,
        hf_batch_sizes=(2, 4),
        prefix_num_requests=4,
        system_prompt_len=48,
        question_len=8,
        prefix_output_len=4,
        sharing_num_prompts=2,
        sharing_output_len=8,
        parallel_num_requests=3,
        parallel_output_scale=1.0,
        parallel_rounds=1,
    ),
    "full": Profile(
        "full",
        num_requests=256,
        serve_rates=(0.5, 1.0, 2.0, 4.0),
        serve_num_requests=64,
        serve_output_scale=0.5,
        prefix_num_requests=32,
        system_prompt_len=1024,
        prefix_output_len=64,
        sharing_num_prompts=8,
        sharing_output_len=128,
        parallel_num_requests=32,
        parallel_output_scale=1.0,
    ),
}


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int  # generated with ignore_eos, so exactly this many tokens

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    requests: list[BenchRequest]
    profile: Profile

    def summary(self) -> dict:
        prompts = [r.prompt_len for r in self.requests]
        outputs = [r.output_len for r in self.requests]
        return {
            **totals(self.requests),
            "prompt_median": float(np.median(prompts)),
            "prompt_max": max(prompts),
            "output_median": float(np.median(outputs)),
            "output_max": max(outputs),
        }


def totals(requests: list[BenchRequest]) -> dict:
    """How many requests, prompt tokens and output tokens."""
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }


def lognormal_lengths(rng, n: int, median: int, bounds: tuple[int, int], sigma: float) -> list:
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(raw), bounds[0], bounds[1]).astype(int).tolist()


class CorpusSource:
    """Token windows of the corpus, read cyclically, each from its own offset (so that no two
    prompts share a first block: no accidental prefix-cache hits)."""

    def __init__(self, tokenizer, path: Path = CORPUS_PATH) -> None:
        text = " ".join(path.read_text(encoding="utf-8").split())
        self.token_ids = np.array(tokenizer.encode(text, add_special_tokens=False), np.int64)
        if len(self.token_ids) == 0:
            raise ValueError(f"{path} tokenizes to nothing.")

    def offsets(self, rng: np.random.Generator, n: int) -> list[int]:
        size = len(self.token_ids)
        return rng.choice(size, size=n, replace=n > size).tolist()

    def window(self, offset: int, num_tokens: int) -> list[int]:
        index = (offset + np.arange(num_tokens)) % len(self.token_ids)
        return self.token_ids[index].tolist()


def make_workload(tokenizer, profile: Profile) -> Workload:
    n, rng, p = profile.num_requests, np.random.default_rng(profile.seed), profile
    prompt_lens = lognormal_lengths(rng, n, p.prompt_median, p.prompt_range, p.sigma)
    output_lens = lognormal_lengths(rng, n, p.output_median, p.output_range, p.sigma)
    corpus = CorpusSource(tokenizer)
    lengths = zip(corpus.offsets(rng, n), prompt_lens, output_lens, strict=True)
    requests = [BenchRequest(corpus.window(at, size), out) for at, size, out in lengths]
    return Workload(requests, profile)


def shared_prefix_workload(
    tokenizer, num_requests: int, system_len: int, suffix_len: int, output_len: int, seed: int = 1
) -> list[BenchRequest]:
    """Requests that share one long system prompt, each with its own short question."""
    rng = np.random.default_rng(seed)
    corpus = CorpusSource(tokenizer)
    system = corpus.window(0, system_len)
    return [
        BenchRequest(system + corpus.window(start, suffix_len), output_len)
        for start in corpus.offsets(rng, num_requests)
    ]


def greedy_inputs(requests: list[BenchRequest]) -> tuple[list[dict], list]:
    """`LLM.generate`'s prompts and greedy params for ``requests`` (ignore_eos)."""
    from pagestream import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    return prompts, params


def scaled(requests: list[BenchRequest], output_scale: float, minimum: int = 8) -> list:
    """The same prompts with output lengths scaled down (shorter serving runs)."""
    return [
        BenchRequest(r.prompt_token_ids, max(minimum, round(r.output_len * output_scale)))
        for r in requests
    ]
