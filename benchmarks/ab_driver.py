"""ABDriver: the one offline A/B benchmark. Variants (benchmarks/variant.py) of one engine run
side by side on the same workloads (benchmarks/ab_workload.py), greedy, through the in-process
`LLM.generate`, and each becomes rows of one schema (benchmarks/row.py) against the first
variant, the baseline.

Each round runs every variant once, in an order rotated each round, on an engine of its own
(prefix caching off unless the driver's engine arguments say otherwise), warmed up at one
request and at the largest batch with every adapter it serves, so that neither the first
calls nor loading adapters is timed; then every workload at each of its batches (B requests
per generate call; None: all of them in one call). Per run: output tokens/s (every output
token over the wall time of the generate calls), TPOT (per request, its first to its last
token over its tokens - 1; the median request, benchmarks/token_clock.py) and the greedy
tokens; a probe may count more (speculation's counters). Rows: medians over the rounds,
each ratio the median of each round's ratio to that round's baseline run."""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from benchmarks.ab_workload import ABWorkload
from benchmarks.offline import make_llm, timed_generate, token_ids, warm_up
from benchmarks.results import rotated
from benchmarks.row import Row
from benchmarks.token_clock import TokenClock
from benchmarks.variant import Variant
from benchmarks.workload import BenchRequest, greedy_inputs

logger = logging.getLogger(__name__)


class Probe(Protocol):
    """What a feature counts during each run, beside the driver's figures."""

    def snapshot(self, llm) -> object: ...

    def counted(self, before: object, after: object) -> dict: ...  # one run's counts

    def summary(self, counts: list[dict]) -> dict: ...  # a row's extras from its rounds'


@dataclass
class ABDriver:
    model: str
    workloads: list[ABWorkload]
    rounds: int
    dtype: str = "auto"
    kv_cache_memory: str = "2GiB"
    engine: dict = field(default_factory=lambda: {"enable_prefix_caching": False})
    probe: Probe | None = None
    engines: dict[str, dict] = field(default_factory=dict)  # label -> what its engine held
    found: dict[tuple, list[dict]] = field(default_factory=dict)  # (label, workload, batch)
    # A driver of another kind of engine (embeddings.py's) overrides start, held, measure
    # and row.

    def run(self, variants: list[Variant]) -> list[dict]:
        """Every variant's rows (in the variants' order within each workload and batch)."""
        for round_index in range(self.rounds):
            for variant in rotated(variants, round_index):
                self._run_variant(variant)
        baseline = variants[0].label
        rows = []
        for workload in self.workloads:
            for batch in dict.fromkeys(b for v in variants for b in v.batches_of(workload)):
                for variant in variants:
                    runs = self.found.get((variant.label, workload.name, batch))
                    if runs:
                        base = self.found[(baseline, workload.name, batch)]
                        rows.append(self.row(variant, workload, batch, runs, base))
        return rows

    def _run_variant(self, variant: Variant) -> None:
        """Every workload and batch of one variant on an engine of its own; each run
        appended to found[(label, workload, batch)], what the engine held to engines."""
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
        return Row.of(variant.label, workload.name, batch, runs, baseline, extras).as_dict()

    @contextlib.contextmanager
    def start(self, variant: Variant) -> Iterator:
        """The variant's engine (the driver's engine arguments and its own), warmed up;
        closed with its worker processes before the next one starts."""
        kwargs = {"model": self.model, "dtype": self.dtype, **self.engine, **variant.engine}
        llm = make_llm(kv_cache_memory=self.kv_cache_memory, **kwargs)
        try:
            self._warm_up(llm, variant)
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

    def _warm_up(self, llm, variant: Variant) -> None:
        """The first calls, at one request and at the largest batch with every adapter (short
        prompts, a few tokens: the proposer's paths too), then an empty prefix cache."""
        requests = self.workloads[0].requests
        warm_up(llm, requests[0])
        largest = max(b or len(w.requests) for w in self.workloads for b in w.batches)
        short = [BenchRequest(r.prompt_token_ids[:32], 8) for r in requests[:largest]]
        loras = variant.spread(len(short))
        llm.generate(*greedy_inputs(short), use_tqdm=False, lora_request=loras)
        llm.engine.scheduler.kv.reset_prefix_cache()

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
