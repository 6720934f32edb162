"""Speculative decoding against none, offline on the CPU: `pagestream bench speculative`.

No speculation, ngram at each k and draft models side by side on the A/B driver, over a
copy-heavy and the default workload; the probe adds the spec_decode_* counters to each row."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from benchmarks.ab_driver import ABDriver, ABWorkload, Variant
from benchmarks.results import ratio
from benchmarks.workload import BenchRequest, CorpusSource, Profile, make_workload
from services.common.speculative_config import DEFAULT_DISABLE_BY_BATCH_SIZE

logger = logging.getLogger(__name__)

NO_SPECULATION = "no speculation"
FORCED_DISABLE = 1000  # disable_by_batch_size of the forced-on runs: every batch proposes
LLAMA_QUANTIZED = ("Q4_0", "Q8_0")  # --draft values llama-quantize makes
OWN_GGUF = "gguf"  # --draft: the model's own GGUF file, its blocks kept
TASKS = (
    "Correct the spelling, grammar and punctuation of the text below and return the whole "
    "corrected text.",
    "Edit the text below so that it reads more clearly, keeping every sentence; return the "
    "whole edited text.",
    "Reformat the text below as a bulleted list, one sentence per bullet, keeping the exact "
    "wording.",
    "Summarise the text below in a few sentences, quoting its key sentences word for word "
    "in quotation marks.",
)


@dataclass(frozen=True)
class SpeculativeProfile:
    name: str
    num_requests: int  # per run at least (rounded up to a multiple of its batch)
    rounds: int
    max_tokens: int  # copy: max_tokens; default: the cap on its output lengths
    prompt_range: tuple[int, int]  # the copy workload's prompt lengths (tokens)
    seed: int = 0


SPECULATIVE_PROFILES = {
    "smoke": SpeculativeProfile("smoke", 2, 1, 8, (40, 80)),  # the drivers end to end
    "quick": SpeculativeProfile("quick", 2, 1, 128, (300, 1000)),  # ~10 min on 2 cores
    "full": SpeculativeProfile("full", 4, 3, 256, (300, 1000)),  # ~1 hour on 2 cores
}


@dataclass(frozen=True)
class SpeculativeOptions:
    model: str  # the target's folder (float weights)
    source_model: str  # the model's name or path: its GGUF file is the draft's source
    profile: SpeculativeProfile
    workload_profile: Profile  # the default workload's shapes
    kv_cache_memory: str = "2GiB"
    batches: tuple[int, ...] = (1, 4, 16, 32)  # 32: the default disable_by_batch_size
    ks: tuple[int, ...] = (2, 4, 6)
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    draft: str = "Q4_0"  # Q4_0 / Q8_0 (llama-quantize), gguf (the model's own), a path, none
    draft_k: int = 3
    self_draft: bool = True  # also the target as its own draft
    llama_quantize: str | None = None  # default: $LLAMA_QUANTIZE
    dtype: str = "auto"
    forced_disable: int = FORCED_DISABLE

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1 or min(self.ks, default=1) < 1:
            raise ValueError(f"batches and ks must be >= 1, got {self.batches}, {self.ks}.")
        if self.profile.rounds < 1 or self.profile.num_requests < 1 or self.draft_k < 1:
            raise ValueError("rounds, num_requests and draft_k must be >= 1.")


def chat_prompt(tokenizer, task: str, passage: str) -> list[int]:
    """The task and its passage as one user turn (the model's template, if it has one)."""
    text = f"{task}\n\n{passage}".rstrip()
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def make_workloads(tokenizer, options: SpeculativeOptions) -> list[ABWorkload]:
    """copy: seeded prompts of about a length drawn from prompt_range; default: the profile's
    requests, their output lengths capped at max_tokens."""
    profile = options.profile
    pool = max(b * math.ceil(profile.num_requests / b) for b in options.batches)
    shapes = dataclasses.replace(options.workload_profile, num_requests=pool)
    default = [
        BenchRequest(r.prompt_token_ids, min(r.output_len, profile.max_tokens))
        for r in make_workload(tokenizer, shapes).requests
    ]
    rng = np.random.default_rng(profile.seed)
    corpus = CorpusSource(tokenizer)
    low, high = profile.prompt_range
    lengths = rng.integers(low, high + 1, size=pool).tolist()
    copy = []
    for i, offset in enumerate(corpus.offsets(rng, pool)):
        task = TASKS[i % len(TASKS)]
        room = max(16, lengths[i] - len(chat_prompt(tokenizer, task, "")))
        passage = tokenizer.decode(corpus.window(offset, room)).strip()
        copy.append(BenchRequest(chat_prompt(tokenizer, task, passage), profile.max_tokens))
    shape = {"batches": options.batches, "num_requests": profile.num_requests}
    return [
        ABWorkload("copy", copy, ignore_eos=False, **shape),
        ABWorkload("default", default, ignore_eos=True, **shape),
    ]


def variant(label: str, speculative: dict | None = None, batch: int | None = None) -> Variant:
    """A configuration; its rows' facts: its method, k and disable_by_batch_size."""
    spec = speculative or {}
    facts = {"method": spec.get("method", "none"), "k": spec.get("num_speculative_tokens", 0)}
    facts["disable_by_batch_size"] = spec.get("disable_by_batch_size")
    batches = (batch,) if batch else None
    return Variant(label, {"speculative_config": speculative}, facts, batches=batches)


def resolve_draft(options: SpeculativeOptions) -> dict:
    """The draft of the pair: {"choice", "path" (None: no pair), "note" where it is not the
    one asked for}."""
    from benchmarks.gguf_export import source_gguf
    from benchmarks.quantized import QUANTIZE_ENV, llama_quantized

    choice = options.draft
    found = {"choice": choice, "path": None}
    if choice.lower() in ("", "none"):
        return found
    if choice not in (*LLAMA_QUANTIZED, OWN_GGUF):
        return {**found, "path": choice}
    try:
        source = source_gguf(options.source_model)
    except ValueError as exc:
        logger.warning("no draft pair: %s", exc)
        return {**found, "note": f"not run: {exc}"}
    quantize = options.llama_quantize or os.environ.get(QUANTIZE_ENV)
    made = None if choice == OWN_GGUF else llama_quantized(source, quantize, choice)
    if choice == OWN_GGUF or made:
        return {**found, "path": str(made or source)}
    note = f"no {source.stem}.{choice}.gguf and no ${QUANTIZE_ENV} to make it: "
    note += f"the model's own {source.name} instead"
    logger.warning("draft: %s", note)
    return {**found, "path": str(source), "note": note}


def draft_label(path: str) -> str:
    """A draft's short name: "Q4_0 GGUF" for a ...Q4_0.gguf file, else its file name."""
    name = Path(path)
    return f"{name.stem.rsplit('.', 1)[-1]} GGUF" if name.suffix.lower() == ".gguf" else name.name


def configurations(options: SpeculativeOptions, draft_path: str | None) -> list[Variant]:
    """No speculation, ngram at each k, the drafts; then, at the largest batch when it
    reaches the default disable_by_batch_size, the middle ngram and the last draft with it."""
    forced = {"disable_by_batch_size": options.forced_disable}
    ngram = {"method": "ngram", "prompt_lookup_min": options.prompt_lookup_min}
    ngram["prompt_lookup_max"] = options.prompt_lookup_max
    ngrams = [
        variant(f"ngram k={k}", {**ngram, "num_speculative_tokens": k, **forced})
        for k in options.ks
    ]
    pairs = [("target", options.model)] * options.self_draft
    pairs += [(draft_label(draft_path), draft_path)] if draft_path else []
    spec = {"method": "draft_model", "num_speculative_tokens": options.draft_k, **forced}
    drafts = [variant(f"draft {n} k={options.draft_k}", {**spec, "model": p}) for n, p in pairs]
    largest, default = max(options.batches), DEFAULT_DISABLE_BY_BATCH_SIZE
    again = ngrams[len(ngrams) // 2 :][:1] + drafts[-1:] if largest >= default else []
    defaults = []
    for v in again:
        spec = {**v.engine["speculative_config"], "disable_by_batch_size": default}
        defaults.append(variant(f"{v.label}, default disable_by_batch_size", spec, largest))
    return [variant(NO_SPECULATION), *ngrams, *drafts, *defaults]


def spec_counts(before, after) -> dict:
    """The spec_decode_* counters' growth from `before` to `after` (SchedulerStats)."""
    counts = {
        key: getattr(after, f"spec_decode_{key}") - getattr(before, f"spec_decode_{key}")
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    }
    old = before.spec_decode_num_accepted_tokens_per_pos
    new = after.spec_decode_num_accepted_tokens_per_pos
    counts["accepted_per_pos"] = [n - (old[i] if i < len(old) else 0) for i, n in enumerate(new)]
    return counts


def summed(counts: list[dict]) -> dict:
    """spec_counts over several runs, added up."""
    total = {key: sum(c[key] for c in counts) for key in counts[0] if key != "accepted_per_pos"}
    per_pos = zip_longest(*(c["accepted_per_pos"] for c in counts), fillvalue=0)
    return {**total, "accepted_per_pos": list(map(sum, per_pos))}


def acceptance(counts: list[dict]) -> dict:
    """The runs' acceptance rate (accepted / proposed), accepted proposals per draft and the
    rate at each position (drafts whose proposal there was accepted / drafts)."""
    total = summed(counts)
    drafts, accepted = total["num_drafts"], total["num_accepted_tokens"]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": total["num_draft_tokens"],
        "num_accepted_tokens": accepted,
        "acceptance_rate": ratio(accepted, total["num_draft_tokens"]),
        "mean_accepted": ratio(accepted, drafts, 2),
        "acceptance_per_pos": [round(n / drafts, 3) for n in total["accepted_per_pos"]]
        if drafts
        else [],
    }


def run_speculative(tokenizer, options: SpeculativeOptions) -> dict:
    import torch

    draft = resolve_draft(options)
    workloads = make_workloads(tokenizer, options)
    engine = {"enable_prefix_caching": False, "max_num_seqs": max(options.batches)}
    probe = SimpleNamespace(  # the scheduler's spec_decode_* counters over each run
        snapshot=lambda llm: llm.engine.scheduler.get_stats(),
        counted=spec_counts,
        summary=acceptance,
    )
    profile, memory = options.profile, options.kv_cache_memory
    driver = ABDriver(
        options.model, workloads, profile.rounds, options.dtype, memory, engine, probe
    )
    runs = driver.run(configurations(options, draft["path"]))
    target = driver.engines[NO_SPECULATION]
    path = draft.pop("path")  # the pair's draft: the file that ran, its quantization and bytes
    draft = {"choice": draft.pop("choice"), "file": Path(path).name if path else None, **draft}
    if held := path and driver.engines.get(f"draft {draft_label(path)} k={options.draft_k}"):
        draft["quantization"] = held.get("draft_quantization")
        draft["weight_bytes"] = held.get("draft_weight_bytes")
    return {
        "profile": profile.name,
        "rounds": profile.rounds,
        "num_requests": profile.num_requests,
        "batches": list(options.batches),
        "ks": list(options.ks),
        "prompt_lookup": [options.prompt_lookup_min, options.prompt_lookup_max],
        "draft_k": options.draft_k,
        "forced_disable": options.forced_disable,
        "default_disable": DEFAULT_DISABLE_BY_BATCH_SIZE,
        "threads": torch.get_num_threads(),
        "dtype": target["dtype"],
        "target_weight_bytes": target["weight_bytes"],
        "draft": draft,
        "workloads": {w.name: w.summary() for w in workloads},
        "runs": runs,
    }
