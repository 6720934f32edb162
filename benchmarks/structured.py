"""Structured outputs: what a JSON schema costs, offline, on one engine.

Three parts, in one process:

- Throughput, side by side: the same prompts (each asks for a small JSON person record),
  seeds and max_tokens through ``LLM.generate`` unconstrained and constrained by SCHEMA,
  plus a third run with no grammar whose every request is held to the length its
  constrained output had (ignore_eos): the same steps and batch sizes as the constrained
  run, so the two differ only by what the grammar costs. The variants take turns over
  rounds on one engine (StructuredDriver, the A/B driver's rotated order), the prefix cache
  is emptied before every run, and figures are medians. The scheduler's ``masks`` (bitmask
  rows filled each step) and ``accept`` (matchers advanced) are timed in place, and the
  steps' own timings recorded.
- Grammar compile time on a StructuredOutputManager of the model's tokenizer (its build
  timed apart): cold (admit -> the matcher ready, for a grammar never seen) and cached
  (the same grammar again: a copy of the cached matcher), plus each one's first mask,
  over JSON schemas of growing size, regexes and Lark grammars.
- Mask fill per row: the constrained outputs replayed in lockstep, ``masks`` timed for
  the rows still going at each position (one after another, as the scheduler does), and
  again with llguidance's LLExecutor filling the same rows in parallel (checked to give
  the same bits); each on a fresh manager, cold and then warm.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from benchmarks.ab_driver import ABDriver
from benchmarks.ab_workload import ABWorkload
from benchmarks.grammar_timing import measure_compile, measure_mask_fill
from benchmarks.offline import make_llm, timed_generate
from benchmarks.results import rotated
from benchmarks.step_recorder import StepRecorder, summarize_steps
from benchmarks.variant import Variant

logger = logging.getLogger(__name__)

VARIANTS = ("unconstrained", "json_schema", "matched_length")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "designer", "manager", "scientist", "teacher"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "active"],
    "additionalProperties": False,
}
NAMES = ("Alice Smith", "Bob Lee", "Chen Wu", "Dana Cruz", "Emeka Obi", "Fatima Khan",
         "Goran Ivic", "Hana Sato")  # fmt: skip
ROLES = SCHEMA["properties"]["role"]["enum"]
CITIES = ("Paris", "Oslo", "Lima", "Cairo", "Osaka", "Quito", "Accra")


@dataclass(frozen=True)
class StructuredProfile:
    name: str
    num_prompts: int
    max_tokens: int
    rounds: int
    num_schemas: int  # JSON schemas of growing size for the compile times
    cached_repeats: int = 3  # cached compiles timed per grammar
    # JSON with no whitespace at all (smoke: a tiny random model would otherwise spend its
    # tokens on whitespace); the others keep the default bounded whitespace.
    compact_json: bool = False
    temperature: float = 0.7
    seed: int = 0


STRUCTURED_PROFILES = {
    "smoke": StructuredProfile(
        "smoke", 8, 160, rounds=1, num_schemas=4, cached_repeats=1, compact_json=True
    ),
    "quick": StructuredProfile("quick", 32, 96, rounds=6, num_schemas=30),  # ~3 min
    "full": StructuredProfile("full", 64, 128, rounds=5, num_schemas=50),
}


@dataclass(frozen=True)
class StructuredOptions:
    model: str  # a model folder
    profile: StructuredProfile
    kv_cache_memory: str = "2GiB"
    dtype: str = "float32"
    executor_threads: int = max(2, min(8, os.cpu_count() or 1))


# ---- the workload ----------------------------------------------------------------------
def person_prompts(tokenizer, count: int) -> list[list[int]]:
    """Chat prompts (the model's template, if it has one) asking for a person record."""
    prompts = []
    for i in range(count):
        text = (
            f"Give a JSON record for {NAMES[i % len(NAMES)]}, a {23 + (i * 7) % 40}-year-old "
            f"{ROLES[i % len(ROLES)]} from {CITIES[i % len(CITIES)]}, with the fields name, "
            "age, role, skills (up to 3) and active. Reply with the JSON object only."
        )
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def sampling_params(variant: str, profile: StructuredProfile, lengths: list[int] | None):
    from pagestream import SamplingParams

    common = {"temperature": profile.temperature, "max_tokens": profile.max_tokens}
    params = []
    for i in range(profile.num_prompts):
        extra = {}
        if variant == "json_schema":
            extra = {"structured_outputs": json_constraint(profile)}
        elif variant == "matched_length":
            extra = {"max_tokens": max(1, lengths[i]), "ignore_eos": True}
        params.append(SamplingParams(**{**common, "seed": profile.seed + i, **extra}))
    return params


def json_constraint(profile: StructuredProfile) -> dict:
    return {"json": SCHEMA, "disable_any_whitespace": profile.compact_json}


def valid_record(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# ---- throughput, side by side -----------------------------------------------------------
class GrammarTimer:
    """Times the scheduler's StructuredOutputManager.masks and .accept in place."""

    def __init__(self) -> None:
        self.masks_s = self.accept_s = 0.0
        self.mask_calls = self.mask_rows = self.accepts = 0

    @contextmanager
    def attached(self, manager) -> Iterator[GrammarTimer]:
        masks, accept = manager.masks, manager.accept

        def timed_masks(scheduled, num_tokens, *spec_tokens):
            start = time.perf_counter()
            found = masks(scheduled, num_tokens, *spec_tokens)
            self.masks_s += time.perf_counter() - start
            self.mask_calls += 1
            self.mask_rows += len(found.request_ids) if found else 0
            return found

        def timed_accept(request, token_id):
            start = time.perf_counter()
            status = accept(request, token_id)
            self.accept_s += time.perf_counter() - start
            self.accepts += 1
            return status

        manager.masks, manager.accept = timed_masks, timed_accept
        try:
            yield self
        finally:
            del manager.masks, manager.accept  # back to the class's methods


def run_variant(llm, prompts, params, variant: str, round_index: int) -> tuple[dict, list]:
    """One LLM.generate over every prompt; its record and outputs."""
    llm.engine.scheduler.kv.reset_prefix_cache()
    timer, steps = GrammarTimer(), StepRecorder()
    load = os.getloadavg()[0]
    with timer.attached(llm.engine.scheduler.structured), steps.attached(llm.engine):
        elapsed, outputs = timed_generate(llm, [{"prompt_token_ids": p} for p in prompts], params)
    completions = [o.outputs[0] for o in outputs]
    tokens = sum(len(c.token_ids) for c in completions)
    decode = summarize_steps([r for r in steps.records if r.decode])
    record = {
        "variant": variant,
        "round": round_index,
        "seconds": round(elapsed, 3),
        "num_requests": len(prompts),
        "output_tokens": tokens,
        "requests_per_s": round(len(prompts) / elapsed, 4),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "ms_per_output_token": round(1e3 * elapsed / tokens, 3),
        "mean_output_len": round(tokens / len(prompts), 2),
        "finish_reasons": dict(Counter(c.finish_reason for c in completions)),
        "valid": _validity(completions),
        "num_steps": len(steps.records),
        "mean_seqs_per_step": round(
            statistics.fmean(r.num_seqs for r in steps.records) if steps.records else 0, 2
        ),
        "decode_step": decode,
        "total_forward_s": round(sum(r.forward_s for r in steps.records), 3),
        "total_sample_s": round(sum(r.sample_s for r in steps.records), 3),
        "masks_s": round(timer.masks_s, 4),
        "mask_rows": timer.mask_rows,
        "mask_calls": timer.mask_calls,
        "accept_s": round(timer.accept_s, 4),
        "accepts": timer.accepts,
        "load_average": round(load, 2),
    }
    return record, completions


def _validity(completions) -> dict:
    """How many outputs parse as JSON and validate against SCHEMA, over all and over those
    that finished with "stop" (the ones that ended where the model or grammar chose)."""
    stopped = [c for c in completions if c.finish_reason == "stop"]
    return {
        "valid": sum(valid_record(c.text) for c in completions),
        "stopped": len(stopped),
        "stopped_valid": sum(valid_record(c.text) for c in stopped),
    }


def round_order(round_index: int) -> list[str]:
    """VARIANTS in the A/B driver's order of a round: rotated by the round, so that
    matched_length never comes before the first json_schema run (it takes that run's
    lengths)."""
    return rotated(VARIANTS, round_index)


@dataclass
class StructuredDriver(ABDriver):
    """The A/B driver (benchmarks/ab_driver.py) on one engine: every variant runs on the same
    warmed-up LLM (the schema's grammar compiled once), a run is one LLM.generate over the
    workload's prompts (token ids) with the variant's sampling params (matched_length: the
    last constrained run's lengths), its record kept in `records` in the order run; a row is
    a variant's medians."""

    llm: object = None
    profile: StructuredProfile | None = None
    records: list[dict] = field(default_factory=list)
    constrained: list = field(default_factory=list)  # the last json_schema run's completions

    @contextmanager
    def start(self, variant: Variant) -> Iterator:
        yield self.llm

    def held(self, llm) -> dict:
        return {}

    def measure(self, llm, variant: Variant, workload, batch) -> dict:
        lengths = [len(c.token_ids) for c in self.constrained] or None
        params = sampling_params(variant.label, self.profile, lengths)
        round_index = len(self.found.get((variant.label, workload.name, batch), []))
        prompts = workload.requests  # token ids
        record, completions = run_variant(llm, prompts, params, variant.label, round_index)
        if variant.label == "json_schema":
            self.constrained = completions
        self.records.append(record)
        return {**record, "elapsed_s": record["seconds"]}

    def row(self, variant: Variant, workload, batch, runs, baseline) -> dict:
        return {"variant": variant.label, **_variant_summary(runs)}


def run_side_by_side(llm, prompts, profile: StructuredProfile) -> tuple[list[dict], dict, list]:
    """Every round's runs (their records, in the order run) and their summary (medians per
    variant, the constrained run's ratios), and the last constrained run's completions."""
    warm = sampling_params("json_schema", profile, None)[:2]  # compiles the schema too
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm, False)
    workload = ABWorkload("prompts", prompts)
    driver = StructuredDriver("", [workload], profile.rounds, llm=llm, profile=profile)
    rows = driver.run([Variant(v) for v in VARIANTS])
    return driver.records, summarize_runs(rows), driver.constrained


def summarize_runs(rows: list[dict]) -> dict:
    """Each variant's medians (its row), the ratios against the constrained run."""
    summary = {r["variant"]: {k: v for k, v in r.items() if k != "variant"} for r in rows}
    ours = summary["json_schema"]
    ratios = {}
    for other in ("unconstrained", "matched_length"):
        base = summary[other]
        ratios[other] = {
            key: round(ours[key] / base[key], 3)
            for key in ("output_tokens_per_s", "requests_per_s", "ms_per_output_token")
        }
    return {"variants": summary, "ratios": ratios}


def _variant_summary(runs: list[dict]) -> dict:
    def median(key):
        return round(statistics.median(r[key] for r in runs), 4)

    masks_s = sum(r["masks_s"] for r in runs)
    rows = sum(r["mask_rows"] for r in runs)
    steps = sum(r["num_steps"] for r in runs)
    out = {
        key: median(key)
        for key in (
            "seconds",
            "output_tokens_per_s",
            "requests_per_s",
            "ms_per_output_token",
            "mean_output_len",
            "num_steps",
            "mean_seqs_per_step",
            "total_forward_s",
            "total_sample_s",
        )
    }
    decode = [r["decode_step"] for r in runs if r["decode_step"]["num_steps"]]
    for key in ("wall_ms", "forward_ms", "sample_ms"):
        out[f"decode_{key}"] = round(statistics.median(d[key] for d in decode), 2)
    totals = Counter()
    for r in runs:
        totals.update(r["finish_reasons"])
        totals.update({f"valid_{k}": n for k, n in r["valid"].items()})
    return {
        **out,
        "runs": len(runs),
        "outputs": sum(r["num_requests"] for r in runs),
        "finish_reasons": {k: n for k, n in totals.items() if not k.startswith("valid_")},
        "valid": {k[6:]: n for k, n in totals.items() if k.startswith("valid_")},
        "masks_ms_per_step": round(1e3 * masks_s / steps, 3) if steps else 0.0,
        "masks_us_per_row": round(1e6 * masks_s / rows, 1) if rows else None,
        "masks_share": round(masks_s / sum(r["seconds"] for r in runs), 4),
        "accept_us_per_token": (
            round(1e6 * sum(r["accept_s"] for r in runs) / sum(r["accepts"] for r in runs), 1)
            if any(r["accepts"] for r in runs)
            else None
        ),
    }


# ---- the section ------------------------------------------------------------------------
def run_structured(tokenizer, options: StructuredOptions) -> dict:
    """Every part on one engine; a JSON-ready dict."""
    from services.scheduler.structured_output_manager import (
        StructuredOutputManager,
        tokenizer_json_of,
    )

    profile = options.profile
    prompts = person_prompts(tokenizer, profile.num_prompts)
    llm = make_llm(options.model, options.dtype, options.kv_cache_memory)
    engine_manager = llm.engine.scheduler.structured
    runs, summary, constrained = run_side_by_side(llm, prompts, profile)

    def make_manager():
        return StructuredOutputManager(
            tokenizer_json_of(options.model),
            engine_manager.vocab_size,
            engine_manager.eos_token_ids,
        )

    fresh = make_manager()
    try:
        compile_times = measure_compile(fresh, profile.num_schemas, profile.cached_repeats)
    finally:
        fresh.close()
    mask_fill = measure_mask_fill(
        make_manager,
        [c.token_ids for c in constrained],
        json_constraint(profile),
        options.executor_threads,
    )
    return {
        "profile": asdict(profile),
        "schema": SCHEMA,
        "workload": {
            "num_prompts": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "max_tokens": profile.max_tokens,
            "temperature": profile.temperature,
            "compact_json": profile.compact_json,
            "example_prompt": tokenizer.decode(prompts[0]),
        },
        "example_output": constrained[0].text if constrained else None,
        "torch_threads": _torch_threads(),
        "runs": runs,
        "summary": summary,
        "compile": compile_times,
        "mask_fill": mask_fill,
    }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
