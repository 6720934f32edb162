"""ABDriver: the one offline A/B benchmark. Variants of one engine, each on an engine of its
own in rounds of rotated order, run the same ABWorkloads greedily through `LLM.generate`
(B requests per call); each run's tok/s, TPOT and tokens become rows (ab_row) against the
first variant: medians over the rounds, ratios the median of each round's ratio."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from benchmarks.offline import make_llm, timed_generate, token_ids, warm_up
from benchmarks.results import agreement, median, ratio, rotated
from benchmarks.workload import BenchRequest, greedy_inputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One configuration: its engine arguments, its rows' facts and its requests' adapters."""

    label: str
    engine: dict = field(default_factory=dict)  # LLM(...) arguments over the driver's
    facts: dict = field(default_factory=dict)  # its rows' extras: what it is (method, rank)
    adapters: tuple = ()  # LoRARequests spread round-robin over the requests
    batches: tuple[int | None, ...] | None = None  # only these batches (None: the workload's)
    workloads: tuple[str, ...] | None = None  # only these workloads (None: every one)

    def runs(self, workload) -> bool:
        return self.workloads is None or workload.name in self.workloads

    def batches_of(self, workload) -> tuple[int | None, ...]:
        return self.batches or workload.batches

    def spread(self, count: int, most: int | None = None) -> list:
        """Request i's adapter: adapters[i mod n] of the first `most` (None without any)."""
        adapters = self.adapters[:most] if most else self.adapters
        return [adapters[i % len(adapters)] if adapters else None for i in range(count)]


@dataclass(frozen=True)
class ABWorkload:
    """One workload: its requests (output_len: max_tokens), EOS or not, its batches."""

    name: str
    requests: list[BenchRequest]
    ignore_eos: bool = True
    batches: tuple[int | None, ...] = (None,)  # requests per generate call (None: all)
    num_requests: int | None = None  # per run at least (rounded up to its batch; None: all)
    max_adapters: int | None = None  # a variant's first adapters only (one chat: 1)

    def for_batch(self, batch: int | None) -> list[BenchRequest]:
        if self.num_requests is None:
            return self.requests
        step = batch or 1
        return self.requests[: step * math.ceil(self.num_requests / step)]

    def inputs(self, requests: list[BenchRequest]) -> tuple[list[dict], list]:
        from pagestream import SamplingParams

        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [
            SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=self.ignore_eos)
            for r in requests
        ]
        return prompts, params

    def summary(self) -> dict:
        prompts = [r.prompt_len for r in self.requests]
        return {
            "num_requests": len(self.requests),
            "prompt_tokens": sum(prompts),
            "prompt_min": min(prompts),
            "prompt_median": float(np.median(prompts)),
            "prompt_max": max(prompts),
            "max_tokens": max(r.output_len for r in self.requests),
            "ignore_eos": self.ignore_eos,
        }


def ab_row(variant: str, workload: str, batch, runs, baseline, extras=None) -> dict:
    """The one row schema: round i's runs (elapsed_s, output_tokens, tpot_ms, token_ids)
    against the baseline's round i; agreement with the baseline's first round (the round of
    `runs` that agrees least); then the extras."""
    tok_s = [r["output_tokens"] / r["elapsed_s"] for r in runs]
    base_tok_s = [r["output_tokens"] / r["elapsed_s"] for r in baseline]
    tpot = [r["tpot_ms"] for r in runs]
    reference = baseline[0]["token_ids"]
    same = min((agreement(r["token_ids"], reference) for r in runs), key=lambda a: a["equal"])
    pairs = list(zip(runs, baseline, strict=True))
    return {
        "variant": variant,
        "workload": workload,
        "batch": batch,  # requests per generate call (None: all of them in one)
        "requests": same["requests"],
        "output_tokens": runs[0]["output_tokens"],
        "output_tok_s": median(tok_s, 2),
        "output_tok_s_per_round": [round(x, 2) for x in tok_s],
        "tpot_ms": median(tpot, 2),  # the median request's, median over the rounds
        "tpot_ms_per_round": [None if t is None else round(t, 2) for t in tpot],
        "vs_baseline": median([ratio(a, b) for a, b in zip(tok_s, base_tok_s, strict=True)]),
        "tpot_vs_baseline": median([ratio(r["tpot_ms"], b["tpot_ms"]) for r, b in pairs]),
        "equal_outputs": same["equal"],
        "differing_outputs": same["requests"] - same["equal"],
        "mean_first_difference": same["mean_first_difference"],
        **(extras or {}),
    }


class TokenClock:
    """When each request's tokens arrive, from every engine step's outputs."""

    def __init__(self) -> None:
        self.seen: dict[str, list] = {}  # request id -> [first, last, tokens]

    @contextlib.contextmanager
    def attached(self, engine) -> Iterator[TokenClock]:
        """Clock the outputs of `engine` (a pagestream LLMEngine) inside the block."""
        core = engine.core
        step = core.step

        def clocked():
            batches = step()
            now = time.perf_counter()
            for output in (o for batch in batches.values() for o in batch.outputs):
                self._saw(output.request_id, len(output.new_token_ids), now)
            return batches

        core.step = clocked
        try:
            yield self
        finally:
            del core.step  # back to the class's method

    def _saw(self, request_id: str, num_tokens: int, now: float) -> None:
        if num_tokens:
            seen = self.seen.setdefault(request_id, [now, now, 0])
            seen[1] = now
            seen[2] += num_tokens

    def tpot_ms(self) -> list[float]:
        """Each request's time per output token after its first (requests of 2+ tokens)."""
        return [(last - first) / (n - 1) * 1e3 for first, last, n in self.seen.values() if n > 1]


@dataclass
class ABDriver:
    """Variants over workloads in rotated rounds. A probe (snapshot(llm), counted(before,
    after), summary(counts)) adds a feature's counts; embeddings.py and structured.py
    override start, held, measure and row."""

    model: str
    workloads: list[ABWorkload]
    rounds: int
    dtype: str = "auto"
    kv_cache_memory: str = "2GiB"
    engine: dict = field(default_factory=lambda: {"enable_prefix_caching": False})
    probe: object | None = None
    engines: dict[str, dict] = field(default_factory=dict)  # label -> what its engine held
    found: dict[tuple, list[dict]] = field(default_factory=dict)  # (label, workload, batch)

    def run(self, variants: list[Variant]) -> list[dict]:
        """Every variant's rows (in the variants' order within each workload and batch)."""
        for round_index in range(self.rounds):
            for variant in rotated(variants, round_index):
                self._run_variant(variant)
        rows = []
        for workload in self.workloads:
            for batch in dict.fromkeys(b for v in variants for b in v.batches_of(workload)):
                base = self.found.get((variants[0].label, workload.name, batch))
                for variant in variants:
                    if runs := self.found.get((variant.label, workload.name, batch)):
                        rows.append(self.row(variant, workload, batch, runs, base))
        return rows

    def _run_variant(self, variant: Variant) -> None:
        """Every workload and batch of one variant on an engine of its own."""
        with self.start(variant) as engine:
            for workload in filter(variant.runs, self.workloads):
                for batch in variant.batches_of(workload):
                    run = self.measure(engine, variant, workload, batch)
                    self.found.setdefault((variant.label, workload.name, batch), []).append(run)
                    what = (variant.label, workload.name, batch, run["elapsed_s"])
                    logger.info("%s, %s, batch %s: %.2f s", *what)
            self.engines[variant.label] = self.held(engine)

    def row(self, variant, workload, batch, runs, baseline) -> dict:
        extras = dict(variant.facts)
        if self.probe is not None:
            extras |= self.probe.summary([r["counts"] for r in runs])
        return ab_row(variant.label, workload.name, batch, runs, baseline, extras)

    @contextlib.contextmanager
    def start(self, variant: Variant) -> Iterator:
        """The variant's engine, warmed up; closed with its workers before the next starts."""
        kwargs = {"model": self.model, "dtype": self.dtype, **self.engine, **variant.engine}
        llm = make_llm(kv_cache_memory=self.kv_cache_memory, **kwargs)
        try:
            requests = self.workloads[0].requests
            warm_up(llm, requests[0])
            largest = max(b or len(w.requests) for w in self.workloads for b in w.batches)
            short = [BenchRequest(r.prompt_token_ids[:32], 8) for r in requests[:largest]]
            loras = variant.spread(len(short))  # every adapter loaded, the proposer's paths run
            llm.generate(*greedy_inputs(short), use_tqdm=False, lora_request=loras)
            llm.engine.scheduler.kv.reset_prefix_cache()
            yield llm
        finally:
            llm.engine.close()
            del llm
            gc.collect()

    def held(self, llm) -> dict:
        """What an engine held: its dtype, quantization and weight bytes (its draft's too)."""
        info = llm.engine.model_info
        held = {"dtype": info.dtype, "quantization": info.quantization}
        held["weight_bytes"] = info.weight_bytes
        draft = getattr(getattr(llm.engine, "worker", None), "draft_model", None)
        if draft is not None:
            held["draft_quantization"] = getattr(draft, "quantization", None)
            held["draft_weight_bytes"] = getattr(draft, "weight_bytes", None)
        return held

    def measure(self, llm, variant: Variant, workload: ABWorkload, batch: int | None) -> dict:
        """One run: the workload's requests for `batch`, `batch` per generate call."""
        requests = workload.for_batch(batch)
        prompts, params = workload.inputs(requests)
        loras = variant.spread(len(requests), workload.max_adapters)
        step = batch or len(prompts)
        clock, elapsed, tokens = TokenClock(), 0.0, []
        before = self.probe.snapshot(llm) if self.probe else None
        with clock.attached(llm.engine):
            for start in range(0, len(prompts), step):
                chunk = slice(start, start + step)
                seconds, outputs = timed_generate(
                    llm, prompts[chunk], params[chunk], lora_request=loras[chunk]
                )
                elapsed += seconds
                tokens += token_ids(outputs)
        tpots = clock.tpot_ms()
        run = {
            "elapsed_s": elapsed,
            "output_tokens": sum(map(len, tokens)),
            "tpot_ms": statistics.median(tpots) if tpots else None,
            "token_ids": tokens,
        }
        if self.probe is not None:
            run["counts"] = self.probe.counted(before, self.probe.snapshot(llm))
        return run
