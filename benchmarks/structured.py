"""Structured outputs: what a JSON schema costs, offline, on one engine: `pagestream bench
structured`. Throughput with and without SCHEMA (and at the constrained lengths without),
grammar compile times (cold and cached) and the mask fill per row (serial and parallel).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

from benchmarks.ab_driver import ABDriver, ABWorkload, Variant
from benchmarks.embeddings import seconds
from benchmarks.grammar_timing import EXECUTOR_THREADS, measure_compile, measure_mask_fill
from benchmarks.offline import make_llm, timed_generate
from benchmarks.step_recorder import StepRecorder, summarize_steps

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
TIMED = ("masks_s", "mask_rows", "mask_calls", "accept_s", "accepts")  # timed_grammar's
RATIOS = ("output_tokens_per_s", "requests_per_s", "ms_per_output_token")
MEDIANS = ("seconds", *RATIOS, "mean_output_len", "num_steps", "mean_seqs_per_step")
MEDIANS += ("total_forward_s", "total_sample_s")  # a run's figures a variant's medians hold


@dataclass(frozen=True)
class StructuredProfile:
    name: str
    num_prompts: int
    max_tokens: int
    rounds: int
    num_schemas: int  # JSON schemas of growing size for the compile times
    cached_repeats: int = 3  # cached compiles timed per grammar
    compact_json: bool = False  # no whitespace (smoke: a random model spends tokens on it)
    temperature: float = 0.7
    seed: int = 0


STRUCTURED_PROFILES = {
    "smoke": StructuredProfile("smoke", 8, 160, 1, 4, cached_repeats=1, compact_json=True),
    "quick": StructuredProfile("quick", 32, 96, rounds=6, num_schemas=30),  # ~3 min
    "full": StructuredProfile("full", 64, 128, rounds=5, num_schemas=50),
}


@dataclass(frozen=True)
class StructuredOptions:
    model: str  # a model folder
    profile: StructuredProfile
    kv_cache_memory: str = "2GiB"


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
            chat = [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def sampling_params(variant: str, profile: StructuredProfile, lengths=None) -> list:
    """Seeded per prompt; json_schema: SCHEMA; matched_length: held to `lengths`."""
    from pagestream import SamplingParams

    params = []
    for i in range(profile.num_prompts):
        args = {"temperature": profile.temperature, "max_tokens": profile.max_tokens}
        if variant == "json_schema":
            args["structured_outputs"] = {
                "json": SCHEMA,
                "disable_any_whitespace": profile.compact_json,
            }
        elif variant == "matched_length":
            args |= {"max_tokens": max(1, lengths[i]), "ignore_eos": True}
        params.append(SamplingParams(**args, seed=profile.seed + i))
    return params


def valid_record(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@contextlib.contextmanager
def timed_grammar(manager):
    """A Counter of the scheduler's manager.masks and .accept timed in place."""
    totals, masks, accept = Counter(), manager.masks, manager.accept

    def timed_masks(*args):
        elapsed, found = seconds(masks, *args)
        rows = len(found.request_ids) if found else 0
        totals.update(masks_s=elapsed, mask_calls=1, mask_rows=rows)
        return found

    def timed_accept(*args):
        elapsed, status = seconds(accept, *args)
        totals.update(accept_s=elapsed, accepts=1)
        return status

    manager.masks, manager.accept = timed_masks, timed_accept
    try:
        yield totals
    finally:
        del manager.masks, manager.accept  # back to the class's methods


@dataclass
class StructuredDriver(ABDriver):
    """The A/B driver on one warmed-up engine: a run is one LLM.generate of the variant's
    sampling params (matched_length: the last constrained run's lengths) kept in `records`."""

    llm: object = None
    profile: StructuredProfile | None = None
    records: list[dict] = field(default_factory=list)
    constrained: list = field(default_factory=list)  # the last json_schema run's completions

    @contextlib.contextmanager
    def start(self, variant: Variant):
        yield self.llm

    def held(self, llm) -> dict:
        return {}

    def measure(self, llm, variant: Variant, workload, batch) -> dict:
        lengths = [len(c.token_ids) for c in self.constrained]
        params = sampling_params(variant.label, self.profile, lengths)
        prompts = [{"prompt_token_ids": p} for p in workload.requests]
        llm.engine.scheduler.kv.reset_prefix_cache()
        steps, load = StepRecorder(), os.getloadavg()[0]
        with timed_grammar(llm.engine.scheduler.structured) as timer, steps.attached(llm.engine):
            elapsed, outputs = timed_generate(llm, prompts, params)
        completions, records = [o.outputs[0] for o in outputs], steps.records
        if variant.label == "json_schema":
            self.constrained = completions
        count, tokens = len(prompts), sum(len(c.token_ids) for c in completions)
        stopped = [c for c in completions if c.finish_reason == "stop"]
        record = {
            "variant": variant.label,
            "round": len(self.found.get((variant.label, workload.name, batch), [])),
            "seconds": round(elapsed, 3),
            "num_requests": count,
            "output_tokens": tokens,
            "requests_per_s": round(count / elapsed, 4),
            "output_tokens_per_s": round(tokens / elapsed, 2),
            "ms_per_output_token": round(1e3 * elapsed / tokens, 3),
            "mean_output_len": round(tokens / count, 2),
            "finish_reasons": dict(Counter(c.finish_reason for c in completions)),
            "valid": {  # over all outputs and over those that ended with "stop"
                "valid": sum(valid_record(c.text) for c in completions),
                "stopped": len(stopped),
                "stopped_valid": sum(valid_record(c.text) for c in stopped),
            },
            "num_steps": len(records),
            "mean_seqs_per_step": round(statistics.fmean(r.num_seqs for r in records), 2),
            "decode_step": summarize_steps([r for r in records if r.decode]),
            "total_forward_s": round(sum(r.forward_s for r in records), 3),
            "total_sample_s": round(sum(r.sample_s for r in records), 3),
            **{k: round(timer[k], 4) for k in TIMED},
            "load_average": round(load, 2),
        }
        self.records.append(record)
        return {**record, "elapsed_s": record["seconds"]}

    def row(self, variant: Variant, workload, batch, runs, baseline) -> dict:
        """The variant's medians over its runs, its outputs' totals and its grammar costs."""
        total, finish, valid = Counter(), Counter(), Counter()
        for r in runs:
            total.update({k: r[k] for k in ("seconds", "num_steps", *TIMED)})
            finish.update(r["finish_reasons"])
            valid.update(r["valid"])
        decode = [r["decode_step"] for r in runs if r["decode_step"]["num_steps"]]
        steps, rows, accepts = total["num_steps"], total["mask_rows"], total["accepts"]
        return {
            **{k: round(statistics.median(r[k] for r in runs), 4) for k in MEDIANS},
            **{
                f"decode_{k}": round(statistics.median(d[k] for d in decode), 2)
                for k in ("wall_ms", "forward_ms", "sample_ms")
            },
            "runs": len(runs),
            "outputs": sum(r["num_requests"] for r in runs),
            "finish_reasons": dict(finish),
            "valid": dict(valid),
            "masks_ms_per_step": round(1e3 * total["masks_s"] / steps, 3) if steps else 0.0,
            "masks_us_per_row": round(1e6 * total["masks_s"] / rows, 1) if rows else None,
            "masks_share": round(total["masks_s"] / total["seconds"], 4),
            "accept_us_per_token": round(1e6 * total["accept_s"] / accepts, 1) if accepts else None,
        }


def run_structured(tokenizer, options: StructuredOptions) -> dict:
    """Every part on one engine; a JSON-ready dict."""
    import torch

    from services.common.structured_outputs import StructuredOutputsParams
    from services.scheduler import structured_output_manager as som

    profile = options.profile
    prompts = person_prompts(tokenizer, profile.num_prompts)
    llm = make_llm(options.model, "float32", options.kv_cache_memory)
    warm = sampling_params("json_schema", profile)[:2]  # compiles the schema too
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm, False)
    workloads = [ABWorkload("prompts", prompts)]
    driver = StructuredDriver("", workloads, profile.rounds, llm=llm, profile=profile)
    rows = driver.run([Variant(v) for v in VARIANTS])
    variants = dict(zip(VARIANTS, rows, strict=True))
    ratios = {
        other: {k: round(variants["json_schema"][k] / variants[other][k], 3) for k in RATIOS}
        for other in ("unconstrained", "matched_length")
    }
    engine = llm.engine.scheduler.structured
    args = (som.tokenizer_json_of(options.model), engine.vocab_size, engine.eos_token_ids)

    @contextlib.contextmanager
    def make_manager():
        manager = som.StructuredOutputManager(*args)
        try:
            yield manager
        finally:
            manager.close()

    with make_manager() as manager:
        compile_times = measure_compile(manager, profile.num_schemas, profile.cached_repeats)
    outputs = [c.token_ids for c in driver.constrained]
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=profile.compact_json)
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
        "example_output": driver.constrained[0].text if driver.constrained else None,
        "torch_threads": torch.get_num_threads(),
        "runs": driver.records,
        "summary": {"variants": variants, "ratios": ratios},
        "compile": compile_times,
        "mask_fill": measure_mask_fill(make_manager, outputs, constraint, EXECUTOR_THREADS),
    }
