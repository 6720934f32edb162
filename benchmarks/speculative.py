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

Each round runs every configuration once, in an order rotated each round, on an engine of
its own (no prefix caching, warmed up at one request and at the largest batch) over every
workload and batch; figures are medians over the rounds, each ratio the median of each
round's ratio to that round's run without speculation. Per run: output tokens/s (every
output token over the wall time of the generate calls), TPOT (per request, its first to its
last token over its tokens - 1; the median request), the scheduler's spec_decode_* counters
(their difference over the run, summed over the rounds) and how many requests' greedy
tokens differ from the run without speculation (speculation verifies with the target: none
should).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.offline import make_llm, timed_generate, token_ids, warm_up
from benchmarks.results import against_baseline, ratio, rotated
from benchmarks.token_clock import TokenClock
from benchmarks.workload import (
    BenchRequest,
    CorpusSource,
    Profile,
    greedy_inputs,
    make_workload,
)
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
@dataclass(frozen=True)
class SpecWorkload:
    name: str
    requests: list[BenchRequest]  # output_len: the request's max_tokens
    ignore_eos: bool

    def for_batch(self, batch: int, num_requests: int) -> list[BenchRequest]:
        return self.requests[: batch * math.ceil(num_requests / batch)]

    def inputs(self, requests: list[BenchRequest]) -> tuple[list[dict], list]:
        from pagestream import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=self.ignore_eos)
            for r in requests
        ]
        return prompts, params

    def summary(self) -> dict:
        lengths = [r.prompt_len for r in self.requests]
        return {
            "pool": len(self.requests),
            "prompt_min": min(lengths),
            "prompt_median": float(np.median(lengths)),
            "prompt_max": max(lengths),
            "max_tokens": max(r.output_len for r in self.requests),
            "ignore_eos": self.ignore_eos,
        }


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


def make_workloads(tokenizer, options: SpeculativeOptions) -> list[SpecWorkload]:
    profile = options.profile
    pool = max(b * math.ceil(profile.num_requests / b) for b in options.batches)
    default = make_workload(
        tokenizer, dataclasses.replace(options.workload_profile, num_requests=pool)
    ).requests
    default = [
        BenchRequest(r.prompt_token_ids, min(r.output_len, profile.max_tokens)) for r in default
    ]
    return [
        SpecWorkload("copy", copy_requests(tokenizer, pool, profile), ignore_eos=False),
        SpecWorkload("default", default, ignore_eos=True),
    ]


# ---- the configurations ----------------------------------------------------------------
@dataclass(frozen=True)
class SpecConfig:
    label: str
    speculative: dict | None = None  # LLM(speculative_config=...)
    batch: int | None = None  # runs at this batch only (None: at every batch)

    def describe(self) -> dict:
        spec = self.speculative or {}
        return {
            "method": spec.get("method", "none"),
            "k": spec.get("num_speculative_tokens", 0),
            "disable_by_batch_size": spec.get("disable_by_batch_size"),
        }


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


def configurations(options: SpeculativeOptions, draft_path: str | None) -> list[SpecConfig]:
    """No speculation, ngram at each k, the drafts; then, at the largest batch when it
    reaches the default disable_by_batch_size, the middle ngram and the last draft with it."""
    forced = {"disable_by_batch_size": options.forced_disable}
    ngram = {
        "method": "ngram",
        "prompt_lookup_min": options.prompt_lookup_min,
        "prompt_lookup_max": options.prompt_lookup_max,
    }
    ngrams = [
        SpecConfig(f"ngram k={k}", {**ngram, "num_speculative_tokens": k, **forced})
        for k in options.ks
    ]
    drafts = [("target", options.model)] * options.self_draft
    if draft_path:
        drafts.append((draft_label(draft_path), draft_path))
    draft_runs = [
        SpecConfig(
            f"draft {label} k={options.draft_k}",
            {"method": "draft_model", "model": path, "num_speculative_tokens": options.draft_k}
            | forced,
        )
        for label, path in drafts
    ]
    largest = max(options.batches)
    defaults = []
    if largest >= DEFAULT_DISABLE_BY_BATCH_SIZE:
        chosen = ngrams[len(ngrams) // 2 :][:1] + draft_runs[-1:]
        defaults = [
            SpecConfig(
                f"{c.label}, default disable_by_batch_size",
                {**c.speculative, "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE},
                largest,
            )
            for c in chosen
        ]
    return [SpecConfig(NO_SPECULATION), *ngrams, *draft_runs, *defaults]


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


def measure(llm, workload: SpecWorkload, batch: int, num_requests: int) -> dict:
    """One run: the workload's requests for `batch`, `batch` per generate call."""
    requests = workload.for_batch(batch, num_requests)
    prompts, params = workload.inputs(requests)
    scheduler = llm.engine.scheduler
    clock = TokenClock()
    before, elapsed, tokens = scheduler.get_stats(), 0.0, []
    with clock.attached(llm.engine):
        for start in range(0, len(prompts), batch):
            chunk = slice(start, start + batch)
            seconds, outputs = timed_generate(llm, prompts[chunk], params[chunk])
            elapsed += seconds
            tokens += token_ids(outputs)
    tpots = clock.tpot_ms()
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(map(len, tokens)),
        "tpot_ms": statistics.median(tpots) if tpots else None,
        "spec": spec_counts(before, scheduler.get_stats()),
        "token_ids": tokens,
    }


def warm_up_batch(llm, workload: SpecWorkload, batch: int) -> None:
    """The engine's first calls, at one request and at the largest batch (short prompts,
    a few tokens: its proposer's paths too), before anything is timed."""
    warm_up(llm, workload.requests[0])
    short = [BenchRequest(r.prompt_token_ids[:32], 8) for r in workload.requests[:batch]]
    llm.generate(*greedy_inputs(short), use_tqdm=False)


def _engine_info(llm) -> dict:
    info = llm.engine.model_info
    found = {"dtype": info.dtype, "weight_bytes": info.weight_bytes}
    draft = getattr(getattr(llm.engine, "worker", None), "draft_model", None)
    if draft is not None:
        found["draft_quantization"] = getattr(draft, "quantization", None)
        found["draft_weight_bytes"] = getattr(draft, "weight_bytes", None)
    return found


def run_config(config: SpecConfig, workloads, options: SpeculativeOptions, found: dict) -> dict:
    """Every workload and batch of one configuration on an engine of its own; each run's
    measurement appended to found[(label, workload, batch)]. Returns the engine's info."""
    llm = make_llm(
        options.model,
        options.dtype,
        options.kv_cache_memory,
        max_num_seqs=max(options.batches),
        enable_prefix_caching=False,
        speculative_config=config.speculative,
    )
    warm_up_batch(llm, workloads[0], max(options.batches))
    batches = (config.batch,) if config.batch else options.batches
    for workload in workloads:
        for batch in batches:
            run = measure(llm, workload, batch, options.profile.num_requests)
            found.setdefault((config.label, workload.name, batch), []).append(run)
            logger.info(
                "%s, %s, batch %d: %.1f output tok/s",
                config.label,
                workload.name,
                batch,
                run["output_tokens"] / run["elapsed_s"],
            )
    info = _engine_info(llm)
    del llm
    gc.collect()
    return info


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


def summarize(config: SpecConfig, key: tuple, runs: list[dict], baseline: list[dict]) -> dict:
    """One (configuration, workload, batch): medians over its rounds, its ratios to the
    same rounds' runs without speculation, and its greedy outputs' agreement with theirs
    (the round that agrees least)."""
    return {
        "config": config.label,
        "workload": key[1],
        "batch": key[2],
        **config.describe(),
        **against_baseline(runs, baseline, "none"),
        **acceptance(summed([r["spec"] for r in runs])),
    }


def run_speculative(tokenizer, options: SpeculativeOptions) -> dict:
    import torch

    draft = resolve_draft(options)
    workloads = make_workloads(tokenizer, options)
    configs = configurations(options, draft["path"])
    found: dict[tuple, list[dict]] = {}
    engines: dict[str, dict] = {}
    for round_index in range(options.profile.rounds):
        for config in rotated(configs, round_index):
            engines[config.label] = run_config(config, workloads, options, found)
    by_label = {c.label: c for c in configs}
    runs = [
        summarize(by_label[key[0]], key, measured, found[(NO_SPECULATION, *key[1:])])
        for key, measured in sorted(found.items(), key=_order(configs, workloads))
    ]
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


def _order(configs: list[SpecConfig], workloads: list[SpecWorkload]):
    """Runs in the report's order: workload, batch, then configuration."""
    config_index = {c.label: i for i, c in enumerate(configs)}
    workload_index = {w.name: i for i, w in enumerate(workloads)}
    return lambda item: (workload_index[item[0][1]], item[0][2], config_index[item[0][0]])


def _draft_info(draft: dict, engines: dict, configs: list[SpecConfig]) -> dict:
    """The pair's draft: what was asked, the file that ran, its quantization and bytes."""
    path = draft["path"]
    info = {"choice": draft["choice"], "file": Path(path).name if path else None}
    if draft.get("note"):
        info["note"] = draft["note"]
    labels = [c.label for c in configs if path and (c.speculative or {}).get("model") == path]
    label = labels[-1] if labels else None
    if label in engines:
        info["quantization"] = engines[label].get("draft_quantization")
        info["weight_bytes"] = engines[label].get("draft_weight_bytes")
    return info
