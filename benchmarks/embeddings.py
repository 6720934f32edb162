"""Embeddings against HF transformers' AutoModel on the CPU: `pagestream bench embed`.

Inputs: `num_inputs` passages of the default corpus (benchmarks/workload.py's seeded
synthetic prompts, lengths lognormal around 128 tokens within 8..512: what a retrieval
pipeline embeds), the same token ids for every configuration. Pooling: the last token's
final hidden state, L2-normalized (LAST, the decoder embedding models' default).

pagestream: `LLM(model, runner="pooling").embed(inputs)` in one call (every input an
engine request, continuous batching, chunked prefill), on the float weights at float32 and
at dtype auto (bfloat16 on CPUs with native bf16), and on the model's GGUF file as it is
(its quantized blocks) when the model is one. HF: `AutoModel` at float32 (eager torch on
the CPU, sdpa attention), the inputs in their order in padded batches of each of
`hf_batch_sizes` (right padding, the attention mask, each row's last real position
pooled), then normalized: what a user writes without an inference server.

One input at a time: the first `single_inputs` inputs embedded one after the other (an
interactive query) by pagestream float32 and HF batch 1: the median milliseconds per input.

Each round runs every configuration once, in an order rotated each round (engines and the
HF model built anew each round, a warm-up before timing); figures are medians over the
rounds, ratios the median of each round's ratio to the same round's HF run at its fastest
batch size. Agreement: every configuration's embeddings against HF float32's (cosine
similarity: the lowest and the median over the inputs).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.results import median, ratio, rotated
from benchmarks.workload import Profile, make_workload

logger = logging.getLogger(__name__)

HF = "HF AutoModel float32"


@dataclass(frozen=True)
class EmbedProfile:
    name: str
    num_inputs: int
    rounds: int
    hf_batch_sizes: tuple[int, ...]
    single_inputs: int  # one at a time


# quick on 2 cores: ~2 min a round (64 inputs, 9k tokens; HF batch 1 is the slowest run)
EMBED_PROFILES = {
    "smoke": EmbedProfile("smoke", 8, 1, (1, 4), 2),
    "quick": EmbedProfile("quick", 64, 3, (1, 16), 16),
    "full": EmbedProfile("full", 256, 5, (1, 16, 64), 32),
}


@dataclass(frozen=True)
class EmbedOptions:
    model: str  # the float weights' folder
    source: str  # the model as given (a GGUF name runs its quantized file too)
    profile: EmbedProfile
    kv_cache_memory: str = "2GiB"
    pooling_type: str = "LAST"


@dataclass(frozen=True)
class Config:
    label: str
    model: str | None  # None: HF
    dtype: str = "float32"
    hf_batch: int = 0
    single: bool = False  # also one input at a time


def configurations(options: EmbedOptions, gguf: bool) -> list[Config]:
    configs = [
        Config("pagestream float32", options.model, "float32", single=True),
        Config("pagestream dtype auto", options.model, "auto"),
    ]
    if gguf:
        configs.append(Config("pagestream GGUF (quantized)", options.source, "auto"))
    for size in options.profile.hf_batch_sizes:
        configs.append(Config(f"{HF}, batch {size}", None, hf_batch=size, single=size == 1))
    return configs


def bench_inputs(tokenizer, profile: EmbedProfile, max_len: int) -> list[list[int]]:
    """The passages, none longer than the model's context (`max_len`)."""
    longest = min(512, max_len)
    shapes = Profile(
        "embed",
        profile.num_inputs,
        prompt_median=min(128, longest // 2),
        prompt_range=(8, longest),
        output_median=1,
    )
    return [r.prompt_token_ids[:longest] for r in make_workload(tokenizer, shapes).requests]


# ---- pagestream -----------------------------------------------------------------------
def run_pagestream(config: Config, inputs: list[list[int]], options: EmbedOptions) -> dict:
    from pagestream import LLM

    llm = LLM(
        config.model,
        runner="pooling",
        dtype=config.dtype,
        kv_cache_memory=options.kv_cache_memory,
        pooler_config={"pooling_type": options.pooling_type, "normalize": True},
        enable_prefix_caching=False,  # rounds repeat the inputs: no hits across them
    )
    prompts = [{"prompt_token_ids": ids} for ids in inputs]
    llm.embed(prompts[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.embed(prompts, use_tqdm=False)
    elapsed = time.perf_counter() - start
    single = []
    if config.single:
        for prompt in prompts[: options.profile.single_inputs]:
            start = time.perf_counter()
            llm.embed([prompt], use_tqdm=False)
            single.append(time.perf_counter() - start)
    info = llm.engine.model_info
    run = {
        "elapsed_s": elapsed,
        "embeddings": np.array([o.outputs.embedding for o in outputs], np.float32),
        "single_s": single,
        "dtype": info.dtype,
        "quantization": info.quantization,
    }
    llm.engine.close()
    del llm
    gc.collect()
    return run


# ---- HF -------------------------------------------------------------------------------
def hf_embed(model, batch: list[list[int]]) -> np.ndarray:
    """One padded batch through AutoModel: each row's last real position, normalized."""
    import torch

    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, W, H]
    last = hidden[torch.arange(len(batch)), mask.sum(dim=1) - 1].float()  # [B, H]
    return torch.nn.functional.normalize(last, dim=-1).numpy()


def run_hf(config: Config, inputs: list[list[int]], options: EmbedOptions) -> dict:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(options.model, dtype=torch.float32).eval()
    size = config.hf_batch
    hf_embed(model, inputs[:2])  # warm-up
    start = time.perf_counter()
    parts = [hf_embed(model, inputs[i : i + size]) for i in range(0, len(inputs), size)]
    elapsed = time.perf_counter() - start
    single = []
    if config.single:
        for tokens in inputs[: options.profile.single_inputs]:
            start = time.perf_counter()
            hf_embed(model, [tokens])
            single.append(time.perf_counter() - start)
    del model
    gc.collect()
    return {
        "elapsed_s": elapsed,
        "embeddings": np.concatenate(parts),
        "single_s": single,
        "dtype": "float32",
        "quantization": "none",
    }


# ---- the run ---------------------------------------------------------------------------
def _cosines(got: np.ndarray, reference: np.ndarray) -> np.ndarray:
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    reference = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    return (got * reference).sum(axis=1)


def summarize(config: Config, runs: list[dict], hf_best: list[float], reference, inputs) -> dict:
    tokens = sum(map(len, inputs))
    per_s = [len(inputs) / r["elapsed_s"] for r in runs]
    cosines = _cosines(runs[0]["embeddings"], reference)
    single = [statistics.median(r["single_s"]) * 1000 for r in runs if r["single_s"]]
    return {
        "config": config.label,
        "dtype": runs[0]["dtype"],
        "quantization": runs[0]["quantization"],
        "inputs_per_s": median(per_s),
        "tokens_per_s": median([tokens / r["elapsed_s"] for r in runs], 1),
        "vs_hf": median([ratio(a, b) for a, b in zip(per_s, hf_best, strict=True)]),
        "single_ms": median(single, 1) if single else None,
        "cosine_min": round(float(cosines.min()), 6),
        "cosine_median": round(float(np.median(cosines)), 6),
    }


def run_embed(tokenizer, options: EmbedOptions) -> dict:
    import torch
    from transformers import AutoConfig

    from services.common.model_source import gguf_source

    profile = options.profile
    config = AutoConfig.from_pretrained(options.model)
    inputs = bench_inputs(tokenizer, profile, getattr(config, "max_position_embeddings", 512))
    configs = configurations(options, gguf_source(options.source) is not None)
    found: dict[str, list[dict]] = {c.label: [] for c in configs}
    for round_index in range(profile.rounds):
        for config in rotated(configs, round_index):
            runner = run_hf if config.model is None else run_pagestream
            run = runner(config, inputs, options)
            found[config.label].append(run)
            logger.info("%s: %.1f inputs/s", config.label, len(inputs) / run["elapsed_s"])
    hf_labels = [c.label for c in configs if c.model is None]
    hf_best = [
        max(len(inputs) / found[label][i]["elapsed_s"] for label in hf_labels)
        for i in range(profile.rounds)
    ]
    reference = found[hf_labels[0]][0]["embeddings"]
    lengths = [len(ids) for ids in inputs]
    return {
        "profile": profile.name,
        "rounds": profile.rounds,
        "threads": torch.get_num_threads(),
        "pooling_type": options.pooling_type,
        "inputs": {
            "count": len(inputs),
            "tokens": sum(lengths),
            "median": float(np.median(lengths)),
            "max": max(lengths),
        },
        "single_inputs": profile.single_inputs,
        "runs": [summarize(c, found[c.label], hf_best, reference, inputs) for c in configs],
    }


def with_profile(profile: EmbedProfile, num_inputs: int | None, rounds: int | None):
    changes = {"num_inputs": num_inputs, "rounds": rounds}
    return dataclasses.replace(profile, **{k: v for k, v in changes.items() if v})
