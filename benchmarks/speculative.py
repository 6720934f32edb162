"""Speculative decoding against none, offline on the CPU: `pagestream bench speculative`.

The target is the model's float weights through the in-process `LLM` at dtype auto
(bfloat16 on a CPU with native bf16), greedy, on two workloads:

- copy: chat prompts (the model's template) asking to correct, edit, reformat or summarise
  with quotes a passage of the bundled corpus (benchmarks/data/corpus.txt); prompts of
  `prompt_range` tokens, seeded; up to `max_tokens` tokens, stopping at EOS. Such outputs
  copy much of their prompt: what prompt lookup (ngram) proposes from.
- default: the profile's synthetic prompts (benchmarks/workload.py), their output lengths
  capped at `max_tokens`, ignore_eos.

Batch B: the requests go to `LLM.generate` B at a time (batch 1: one after the other); a
run at batch B takes the workload's first `num_requests` requests, rounded up to a multiple
of B.

Configurations: no speculation; ngram for each k of `ks` (prompt_lookup_min..max); the
draft_model method with k = `draft_k`, the target itself as its draft (every proposal
accepted: what the mechanics cost) and a cheaper draft of the same model and tokenizer
(`draft`; by default a Q4_0 GGUF file that llama-quantize, $LLAMA_QUANTIZE, makes once from
the F32 export of the model's GGUF file, next to it, run with its blocks kept; without
either, the model's own GGUF file, as the results note). They speculate at every batch size
(disable_by_batch_size = `forced_disable`); at the largest batch, when it reaches the
engine's default disable_by_batch_size, the middle ngram and the last draft run again with
that default, to show where proposing stops paying.

They run side by side through the one A/B driver (benchmarks/ab_driver.py: an engine of its
own per configuration and round, prefix caching off, medians over the rounds, ratios to the
run without speculation); its probe adds the scheduler's spec_decode_* counters (their
difference over each run, summed over the rounds) to each row.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.ab_driver import ABDriver
from benchmarks.ab_workload import ABWorkload
from benchmarks.results import ratio
from benchmarks.variant import Variant
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


# One configuration's round at quick (no speculation, 2 cores): ~1 minute, the batch 16 runs
# half of it (16 prompts of ~700 tokens to prefill); quick runs 8 configurations once.
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


# ---- the workloads ---------------------------------------------------------------------
def chat_prompt(tokenizer, task: str, passage: str) -> list[int]:
    """The task and its passage as one user turn (the model's template, if it has one)."""
    text = f"{task}\n\n{passage}".rstrip()
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def copy_requests(tokenizer, count: int, profile: SpeculativeProfile) -> list[BenchRequest]:
    """`count` seeded copy-heavy prompts, each of about a length drawn from prompt_range."""
    rng = np.random.default_rng(profile.seed)
    corpus = CorpusSource(tokenizer)
    low, high = profile.prompt_range
    lengths = rng.integers(low, high + 1, size=count).tolist()
    requests = []
    for i, (length, offset) in enumerate(zip(lengths, corpus.offsets(rng, count), strict=True)):
        task = TASKS[i % len(TASKS)]
        room = max(16, length - len(chat_prompt(tokenizer, task, "")))
        passage = tokenizer.decode(corpus.window(offset, room)).strip()
        requests.append(BenchRequest(chat_prompt(tokenizer, task, passage), profile.max_tokens))
    return requests


def make_workloads(tokenizer, options: SpeculativeOptions) -> list[ABWorkload]:
    profile = options.profile
    pool = max(b * math.ceil(profile.num_requests / b) for b in options.batches)
    default = make_workload(
        tokenizer, dataclasses.replace(options.workload_profile, num_requests=pool)
    ).requests
    default = [
        BenchRequest(r.prompt_token_ids, min(r.output_len, profile.max_tokens)) for r in default
    ]
    copy = copy_requests(tokenizer, pool, profile)
    shape = {"batches": options.batches, "num_requests": profile.num_requests}
    return [
        ABWorkload("copy", copy, ignore_eos=False, **shape),
        ABWorkload("default", default, ignore_eos=True, **shape),
    ]


# ---- the configurations ----------------------------------------------------------------
def describe(speculative: dict | None) -> dict:
    """A configuration's row facts: its method, k and disable_by_batch_size."""
    spec = speculative or {}
    return {
        "method": spec.get("method", "none"),
        "k": spec.get("num_speculative_tokens", 0),
        "disable_by_batch_size": spec.get("disable_by_batch_size"),
    }


def variant(label: str, speculative: dict | None = None, batch: int | None = None) -> Variant:
    return Variant(
        label,
        {"speculative_config": speculative},
        describe(speculative),
        batches=(batch,) if batch else None,
    )


def resolve_draft(options: SpeculativeOptions) -> dict:
    """The draft of the pair: {"choice", "path" (None: no pair), "note" where it is not the
    one asked for}."""
    from benchmarks.gguf_export import source_gguf

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
    if choice == OWN_GGUF:
        return {**found, "path": str(source)}
    return {**found, **_llama_quantized_draft(source, choice, options)}


def _llama_quantized_draft(source: Path, file_type: str, options: SpeculativeOptions) -> dict:
    from benchmarks.quantized import (
        QUANTIZE_ENV,
        is_made,
        llama_quantized,
        llama_quantized_path,
    )

    made = llama_quantized_path(source, file_type)
    quantize = options.llama_quantize or os.environ.get(QUANTIZE_ENV)
    if is_made(made, source):
        return {"path": str(made)}
    if quantize:
        return {"path": str(llama_quantized(source, quantize, file_type))}
    note = (
        f"no {made.name} and no ${QUANTIZE_ENV} to make it: the model's own {source.name} instead"
    )
    logger.warning("draft: %s", note)
    return {"path": str(source), "note": note}


def draft_label(path: str) -> str:
    """A draft's short name: "Q4_0 GGUF" for a ...Q4_0.gguf file, else its file name."""
    name = Path(path)
    if name.suffix.lower() == ".gguf":
        return f"{name.stem.rsplit('.', 1)[-1]} GGUF"
    return name.name


def configurations(options: SpeculativeOptions, draft_path: str | None) -> list[Variant]:
    """No speculation, ngram at each k, the drafts; then, at the largest batch when it
    reaches the default disable_by_batch_size, the middle ngram and the last draft with it."""
    forced = {"disable_by_batch_size": options.forced_disable}
    ngram = {
        "method": "ngram",
        "prompt_lookup_min": options.prompt_lookup_min,
        "prompt_lookup_max": options.prompt_lookup_max,
    }
    ngrams = [
        variant(f"ngram k={k}", {**ngram, "num_speculative_tokens": k, **forced})
        for k in options.ks
    ]
    drafts = [("target", options.model)] * options.self_draft
    if draft_path:
        drafts.append((draft_label(draft_path), draft_path))
    draft_k = {"method": "draft_model", "num_speculative_tokens": options.draft_k, **forced}
    draft_runs = [
        variant(f"draft {label} k={options.draft_k}", {**draft_k, "model": path})
        for label, path in drafts
    ]
    largest = max(options.batches)
    defaults = []
    if largest >= DEFAULT_DISABLE_BY_BATCH_SIZE:
        chosen = ngrams[len(ngrams) // 2 :][:1] + draft_runs[-1:]
        default = {"disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE}
        defaults = [
            variant(
                f"{v.label}, default disable_by_batch_size",
                {**v.engine["speculative_config"], **default},
                largest,
            )
            for v in chosen
        ]
    return [variant(NO_SPECULATION), *ngrams, *draft_runs, *defaults]


# ---- the measurement -------------------------------------------------------------------
def spec_counts(before, after) -> dict:
    """The spec_decode_* counters' growth from `before` to `after` (SchedulerStats)."""
    old = before.spec_decode_num_accepted_tokens_per_pos
    new = after.spec_decode_num_accepted_tokens_per_pos
    return {
        "num_drafts": after.spec_decode_num_drafts - before.spec_decode_num_drafts,
        "num_draft_tokens": after.spec_decode_num_draft_tokens
        - before.spec_decode_num_draft_tokens,
        "num_accepted_tokens": after.spec_decode_num_accepted_tokens
        - before.spec_decode_num_accepted_tokens,
        "accepted_per_pos": [n - (old[i] if i < len(old) else 0) for i, n in enumerate(new)],
    }


def acceptance(counts: dict) -> dict:
    """Acceptance rate (accepted / proposed), accepted proposals per draft and the rate
    at each position (drafts whose proposal there was accepted / drafts)."""
    drafts = counts["num_drafts"]
    return {
        "num_drafts": drafts,
        "num_draft_tokens": counts["num_draft_tokens"],
        "num_accepted_tokens": counts["num_accepted_tokens"],
        "acceptance_rate": ratio(counts["num_accepted_tokens"], counts["num_draft_tokens"]),
        "mean_accepted": ratio(counts["num_accepted_tokens"], drafts, 2),
        "acceptance_per_pos": [round(n / drafts, 3) for n in counts["accepted_per_pos"]]
        if drafts
        else [],
    }


def summed(counts: list[dict]) -> dict:
    """spec_counts over several runs, added up."""
    width = max(len(c["accepted_per_pos"]) for c in counts)
    total = {key: sum(c[key] for c in counts) for key in counts[0] if key != "accepted_per_pos"}
    per_pos = [
        sum(c["accepted_per_pos"][i] for c in counts if i < len(c["accepted_per_pos"]))
        for i in range(width)
    ]
    return {**total, "accepted_per_pos": per_pos}


class SpecCounters:
    """The driver's probe: the scheduler's spec_decode_* counters over each run."""

    def snapshot(self, llm):
        return llm.engine.scheduler.get_stats()

    def counted(self, before, after) -> dict:
        return spec_counts(before, after)

    def summary(self, counts: list[dict]) -> dict:
        return acceptance(summed(counts))


def run_speculative(tokenizer, options: SpeculativeOptions) -> dict:
    import torch

    draft = resolve_draft(options)
    workloads = make_workloads(tokenizer, options)
    configs = configurations(options, draft["path"])
    driver = ABDriver(
        options.model,
        workloads,
        options.profile.rounds,
        options.dtype,
        options.kv_cache_memory,
        {"enable_prefix_caching": False, "max_num_seqs": max(options.batches)},
        probe=SpecCounters(),
    )
    runs = driver.run(configs)
    engines = driver.engines
    return {
        "profile": options.profile.name,
        "rounds": options.profile.rounds,
        "num_requests": options.profile.num_requests,
        "batches": list(options.batches),
        "ks": list(options.ks),
        "prompt_lookup": [options.prompt_lookup_min, options.prompt_lookup_max],
        "draft_k": options.draft_k,
        "forced_disable": options.forced_disable,
        "default_disable": DEFAULT_DISABLE_BY_BATCH_SIZE,
        "threads": torch.get_num_threads(),
        "dtype": engines[NO_SPECULATION]["dtype"],
        "target_weight_bytes": engines[NO_SPECULATION]["weight_bytes"],
        "draft": _draft_info(draft, engines, configs),
        "workloads": {w.name: w.summary() for w in workloads},
        "runs": runs,
    }


def _draft_info(draft: dict, engines: dict, configs: list[Variant]) -> dict:
    """The pair's draft: what was asked, the file that ran, its quantization and bytes."""
    path = draft["path"]
    info = {"choice": draft["choice"], "file": Path(path).name if path else None}
    if draft.get("note"):
        info["note"] = draft["note"]
    specs = [(c.label, c.engine["speculative_config"] or {}) for c in configs]
    labels = [label for label, spec in specs if path and spec.get("model") == path]
    label = labels[-1] if labels else None
    if label in engines:
        info["quantization"] = engines[label].get("draft_quantization")
        info["weight_bytes"] = engines[label].get("draft_weight_bytes")
    return info
