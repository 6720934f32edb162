"""Offline throughput under tensor / pipeline parallelism on the CPU, and what the collectives
cost per step: the layouts take turns round after round on the same greedy prompts, beside
their tp = 1 baseline (medians over rounds, ratios within a round); a layout the model refuses
runs on a head variant (head_variant.py); per step, step_recorder.py's timings and the
collectives' cost estimated from collectives.py's timings of the same tensors.
"""

from __future__ import annotations

import logging
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.ceiling import ModelShapes
from benchmarks.collectives import CollectiveSpec, interpolate_us, measure_collectives
from benchmarks.offline import make_llm, timed_generate, token_ids, warm_up
from benchmarks.step_recorder import StepRecorder
from benchmarks.workload import BenchRequest, greedy_inputs, totals

logger = logging.getLogger(__name__)

DEFAULT_LAYOUTS = ("tp1", "tp1-async", "tp1-mp", "tp2", "tp3", "pp2")
_LAYOUT = re.compile(r"^(?:tp([1-9]\d*))?(?:x?pp([1-9]\d*))?(-mp)?(-async)?$")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    backend: str | None = None  # None: uni in process at world size 1, else mp
    async_scheduling: bool = False

    @classmethod
    def parse(cls, text: str) -> Layout:
        """ "tp1", "tp2", "pp2", "tp2xpp2", then "-mp" (worker processes) and/or "-async"."""
        match = _LAYOUT.match(text.strip().lower())
        if not match or not (match.group(1) or match.group(2)):
            raise ValueError(
                f"layout {text!r}: expected tpN, ppN or tpNxppM (N, M >= 1), then -mp and/or -async"
            )
        tp, pp = int(match.group(1) or 1), int(match.group(2) or 1)
        return cls(tp, pp, "mp" if match.group(3) else None, bool(match.group(4)))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def label(self) -> str:
        parts = [f"tp={self.tp}"] if self.tp > 1 or self.pp == 1 else []
        text = " x ".join(parts + ([f"pp={self.pp}"] if self.pp > 1 else []))
        if self.world_size == 1:
            text += " (worker process)" if self.backend == "mp" else " (in process)"
        return text + (", async scheduling" if self.async_scheduling else "")

    def engine_kwargs(self) -> dict:
        kwargs = {"tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp}
        if self.backend:
            kwargs["distributed_executor_backend"] = self.backend
        return kwargs | ({"async_scheduling": True} if self.async_scheduling else {})


BASELINES = (Layout(), Layout(backend="mp"))  # tp = 1 in process, tp = 1 in a worker process


@dataclass
class ParallelOptions:
    model: str  # a model folder
    layouts: tuple[Layout, ...] = tuple(Layout.parse(t) for t in DEFAULT_LAYOUTS)
    rounds: int = 2
    kv_cache_memory: str | int | None = None  # None: sized to the workload (kv_cache_bytes)
    dtype: str = "float32"
    head_variants: bool = True  # a refused tp runs on a random model with divisible heads
    collective_repeats: int = 40
    engine_kwargs: dict = field(default_factory=dict)


@dataclass
class _Run:
    """One layout on one model and what it measured, round after round."""

    layout: Layout
    model_name: str
    folder: str
    recorder: StepRecorder = field(default_factory=StepRecorder)
    output_tokens_per_s: list[float] = field(default_factory=list)
    elapsed_s: list[float] = field(default_factory=list)
    token_ids: list[list[int]] | None = None
    startup_s: list[float] = field(default_factory=list)


def run_parallel(requests: list[BenchRequest], options: ParallelOptions) -> dict:
    """Collective timings, then every layout round after round; a JSON-ready dict."""
    config = ModelShapes.of(options.model)
    with tempfile.TemporaryDirectory(prefix="pagestream-bench-parallel-") as scratch:
        runs, models, skipped = _plan_runs(options, config, Path(scratch))
        collectives = _measure_collectives(config, runs, options)
        for round_index in range(options.rounds):
            for run in runs:
                _run_round(run, requests, options, round_index)
    return {
        **totals(requests),
        "rounds": options.rounds,
        "dtype": options.dtype,
        "models": models,
        "collectives": collectives,
        "runs": [_run_summary(run, runs, config, collectives) for run in runs],
        "skipped": skipped,
    }


def _plan_runs(options: ParallelOptions, shapes: ModelShapes, scratch: Path) -> tuple:
    """The (layout, model) pairs to run (a refused layout on a head variant, beside its own
    tp = 1 baselines), the models and the layouts nothing can run, with the reason."""
    from benchmarks.head_variant import build_head_variant
    from pagestream.engine_args import EngineArgs
    from pagestream.executor_factory import check_parallel_model

    def refusal(folder: str, layout: Layout) -> str | None:
        try:
            check_parallel_model(EngineArgs(model=folder, **layout.engine_kwargs()))
        except ValueError as exc:
            return str(exc)
        return None

    runs, skipped = [], []
    names = {"num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads"}
    names |= {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size"}
    models = {"model": {key: getattr(shapes, name) for key, name in names.items()}}
    for layout in options.layouts:
        reason = refusal(options.model, layout)
        if reason is None:
            runs.append(_Run(layout, "model", options.model))
            continue
        name, folder = f"head variant for tp={layout.tp}", scratch / f"variant-tp{layout.tp}"
        if options.head_variants and layout.tp > 1 and name not in models:
            description = build_head_variant(Path(options.model), layout.tp, folder)
            if description is not None:
                models[name] = {**description, "refused": reason}
                runs += [
                    _Run(base, name, str(folder))
                    for base in BASELINES
                    if base == Layout() or base in options.layouts
                ]
        if name in models and refusal(str(folder), layout) is None:
            runs.append(_Run(layout, name, str(folder)))
        else:
            skipped.append({"layout": layout.label, "reason": reason})
    return runs, models, skipped


def _measure_collectives(shapes: ModelShapes, runs: list[_Run], options) -> dict:
    """Timings at each world size a tensor-parallel group or a stage boundary uses."""
    sizes = {r.layout.tp for r in runs if r.layout.tp > 1}
    sizes |= {2} if any(r.layout.pp > 1 for r in runs) else set()
    out = {}
    for world_size in sorted(sizes):
        logger.info("collectives between %d processes", world_size)
        spec = CollectiveSpec(
            world_size=world_size,
            hidden_size=shapes.hidden_size,
            vocab_size=shapes.vocab_size,
            repeats=options.collective_repeats,
            num_layers=shapes.num_layers,
            intermediate_size=shapes.intermediate_size,
            qkv_size=shapes.layer_linears()[0][1],
            q_size=shapes.num_heads * shapes.head_dim,
        )
        out[str(world_size)] = measure_collectives(spec)
    return out


def kv_cache_bytes(folder: str, requests: list[BenchRequest], block_size: int = 16) -> int:
    """A KV budget that holds every request at once at tp = 1 (float32), with a margin: no
    layout preempts, and no rank holds gigabytes it never uses."""
    per_token = ModelShapes.of(folder).kv_bytes_per_token()
    blocks = sum(-(-(r.prompt_len + r.output_len) // block_size) + 1 for r in requests)
    return int(blocks * block_size * per_token * 1.25) + 16 * 1024**2


def _run_round(run: _Run, requests, options: ParallelOptions, round_index: int) -> None:
    """Start the layout's engine, warm it up, time the workload, stop it."""
    start = time.perf_counter()
    kv = options.kv_cache_memory or kv_cache_bytes(run.folder, requests)
    kwargs = {"enable_prefix_caching": False, **run.layout.engine_kwargs(), **options.engine_kwargs}
    llm = make_llm(run.folder, options.dtype, kv_cache_memory=kv, **kwargs)
    try:
        run.startup_s.append(time.perf_counter() - start)
        warm_up(llm, requests[0])
        with run.recorder.attached(llm.engine, tag=round_index):
            elapsed, outputs = timed_generate(llm, *greedy_inputs(requests))
    finally:
        llm.engine.close()
    run.token_ids = token_ids(outputs)
    run.elapsed_s.append(elapsed)
    run.output_tokens_per_s.append(sum(map(len, run.token_ids)) / elapsed)
    what = (round_index, run.layout.label, run.model_name, run.output_tokens_per_s[-1])
    logger.info("round %d, %s on %s: %.1f output tok/s", *what)


def _same_model(run: _Run, runs: list[_Run], layout: Layout) -> _Run | None:
    return next((r for r in runs if (r.model_name, r.layout) == (run.model_name, layout)), None)


def _ratio(run: _Run, runs: list[_Run], layout: Layout) -> float | None:
    """The median over rounds of each round's output tok/s ratio to ``layout``'s."""
    base = _same_model(run, runs, layout)
    if base is None:
        return None
    pairs = zip(run.output_tokens_per_s, base.output_tokens_per_s, strict=True)
    return round(statistics.median(a / b for a, b in pairs), 3)


def _run_summary(run: _Run, runs: list[_Run], config, collectives: dict) -> dict:
    base = _same_model(run, runs, Layout())
    rates = run.output_tokens_per_s
    best_round = max(range(len(rates)), key=rates.__getitem__) if rates else None
    identical = None
    if base is not None and run.token_ids is not None and base.token_ids is not None:
        identical = sum(a == b for a, b in zip(run.token_ids, base.token_ids, strict=True))
    estimates = {
        f"collectives{name}_est": cost
        for name, stat in (("", "median"), ("_min", "min"), ("_in_step", "per_call"))
        if (cost := _collective_cost(run.layout, config, collectives, stat)) is not None
    }
    in_process = run.layout.backend is None and run.layout.world_size == 1
    return {
        "layout": run.layout.label,
        "tp": run.layout.tp,
        "pp": run.layout.pp,
        "model": run.model_name,
        "processes": 0 if in_process else run.layout.world_size,
        "startup_s": round(statistics.median(run.startup_s), 1),
        "output_tokens": sum(len(t) for t in run.token_ids or []),
        "elapsed_s": [round(e, 3) for e in run.elapsed_s],
        "output_tokens_per_s": round(statistics.median(rates), 2),
        "output_tokens_per_s_rounds": [round(x, 2) for x in rates],
        "vs_tp1": _ratio(run, runs, Layout()),
        "vs_tp1_worker_process": _ratio(run, runs, Layout(backend="mp")),
        "identical_outputs": identical,
        "steps_per_run": len(run.recorder.records) // max(1, len(run.elapsed_s)),
        "steps_round": best_round,  # step timings from the best round, the least disturbed
        "steps": run.recorder.summary(estimates, tag=best_round),
        "collectives_per_step": _collective_counts(run.layout, config),
    }


def _collective_counts(layout: Layout, config) -> dict:
    """What the output rank (tp rank 0 of the last stage) does per step."""
    layers = config.num_layers // layout.pp  # the last stage's share (even split)
    counts = {}
    if layout.tp > 1:
        counts |= {"all_reduce": 2 * layers + (layout.pp == 1), "gather_logits": 1}
    return counts | ({"recv_hidden": 1} if layout.pp > 1 else {})


def _collective_cost(layout: Layout, config, collectives: dict, stat: str = "median"):
    """step -> estimated seconds of the output rank's collectives at each one's ``stat``
    timing between idle processes ("median" or "min"), or with the all-reduces timed inside
    a step ("per_call", tensor parallelism only); None when there is none."""
    counts = _collective_counts(layout, config)
    tp_table, pp_table = collectives.get(str(layout.tp), {}), collectives.get("2", {})
    in_step = stat == "per_call"
    reduce_table = tp_table.get("all_reduce_in_step_us" if in_step else "all_reduce_us")
    if not counts or (in_step and ("all_reduce" not in counts or not reduce_table)):
        return None

    def cost(step) -> float:
        us = 0.0
        if "all_reduce" in counts:
            us += counts["all_reduce"] * interpolate_us(reduce_table, step.num_tokens, stat)
            gathers = tp_table["gather_logits_us"]
            us += interpolate_us(gathers, step.num_seqs, "median" if in_step else stat)
        if "recv_hidden" in counts:
            us += interpolate_us(pp_table["send_recv_us"], step.num_tokens, stat)
        return us * 1e-6

    return cost
