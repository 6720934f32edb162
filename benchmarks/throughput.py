"""Offline throughput: pagestream ``LLM.generate`` against HF transformers on one workload.

All engines get the same prompts (token ids) and the same per-request output lengths
(ignore_eos / no early stop), in one process, one after the other:

- pagestream ``LLM.generate`` (continuous batching, paged KV cache),
- HF ``generate`` in static padded batches of each size in ``profile.hf_batch_sizes``,
- HF continuous batching (``generate_batch``'s manager) where transformers has it,
- llama.cpp from F32 / BF16 GGUF files of the same weights, when asked
  (benchmarks/llamacpp.py),

plus the matmul ceiling at the model's shapes and each run's fraction of it. KV-cache
utilisation is sampled during pagestream's run (see benchmarks/kv_utilization.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from benchmarks.ceiling import (
    ModelShapes,
    flop_bound_fraction,
    measure_matmul_ceiling,
    workload_flops,
)
from benchmarks.hf_baselines import (
    hf_continuous_batching_available,
    load_hf_model,
    run_hf_continuous,
    run_hf_static,
)
from benchmarks.llamacpp import LlamaCppOptions
from benchmarks.offline import make_llm, run_pagestream
from benchmarks.results import RunResult
from benchmarks.workload import BenchRequest

logger = logging.getLogger(__name__)


@dataclass
class ThroughputOptions:
    model: str  # a model name or folder (resolved like `pagestream serve`)
    hf_batch_sizes: tuple[int, ...] = (8, 16, 32)
    hf_continuous: bool = True
    kv_cache_memory: str = "2GiB"
    dtype: str = "float32"
    extra_dtypes: tuple[str, ...] = ()  # pagestream alone in other dtypes (e.g. bfloat16)
    llamacpp: LlamaCppOptions | None = None  # also run llama.cpp (benchmarks/llamacpp.py)
    engine_kwargs: dict = field(default_factory=dict)


def run_throughput(requests: list[BenchRequest], options: ThroughputOptions) -> dict:
    """Every engine on the same requests; returns a JSON-ready dict (runs, ratios, ceiling)."""
    from services.worker.models.gguf_weights import dequantized_folder

    folder = str(dequantized_folder(options.model))
    llm = make_llm(folder, options.dtype, options.kv_cache_memory, **options.engine_kwargs)
    config = llm.engine.worker.model.config
    ours = run_pagestream(llm, requests, f"pagestream LLM.generate ({options.dtype})")
    reference = None
    if options.llamacpp is not None and options.dtype == "float32":
        from benchmarks.llamacpp import check_requests, pagestream_greedy

        reference = pagestream_greedy(llm, check_requests(requests, options.llamacpp))
    del llm
    runs = [ours]
    runs += _run_hf(folder, requests, options)
    for dtype in options.extra_dtypes:
        other = make_llm(folder, dtype, options.kv_cache_memory, **options.engine_kwargs)
        runs.append(run_pagestream(other, requests, f"pagestream LLM.generate ({dtype})"))
        del other
    llamacpp_info = None
    if options.llamacpp is not None:
        from benchmarks.llamacpp import run_llamacpp_section

        theirs, llamacpp_info = run_llamacpp_section(requests, options.llamacpp, reference, runs)
        runs += theirs
    shapes = ModelShapes.from_config(config)
    flops = workload_flops(shapes, requests)
    result = {
        "runs": [r.as_dict() for r in runs],
        "ratios": {**_ratios(ours, runs[1:]), **_llamacpp_ratios(runs)},
        "ceiling": _ceiling(shapes, flops, options.dtype, runs),
    }
    if "bfloat16" in options.extra_dtypes and options.dtype != "bfloat16":
        result["ceiling_bfloat16"] = _ceiling(shapes, flops, "bfloat16", runs)
    if llamacpp_info is not None:
        result["llamacpp"] = llamacpp_info
    return result


def _is_bf16(run: RunResult) -> bool:
    return "bfloat16" in run.name or "BF16" in run.name


def _ceiling(shapes: ModelShapes, flops: dict, dtype: str, runs: list[RunResult]) -> dict:
    """The matmul ceiling in `dtype` and the fraction of it each run of that dtype reached."""
    ceiling = measure_matmul_ceiling(shapes, dtype=getattr(torch, dtype))
    same_dtype = [r for r in runs if _is_bf16(r) == (dtype == "bfloat16")]
    return {
        "gflops": round(ceiling.gflops, 1),
        "per_shape": ceiling.per_shape,
        "num_tokens": ceiling.num_tokens,
        "dtype": ceiling.dtype,
        "threads": ceiling.threads,
        "workload_gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
        "flop_bound_s": round(flops["total"] / (ceiling.gflops * 1e9), 2),
        "fraction": {
            r.name: float(f"{flop_bound_fraction(flops['total'], r.elapsed_s, ceiling):.3g}")
            for r in same_dtype
        },
    }


def _run_hf(folder: str, requests: list[BenchRequest], options: ThroughputOptions):
    runs: list[RunResult] = []
    if not options.hf_batch_sizes and not options.hf_continuous:
        return runs
    model = load_hf_model(folder, getattr(torch, options.dtype))
    pad_id = model.generation_config.pad_token_id or 0
    for batch_size in options.hf_batch_sizes:
        runs.append(run_hf_static(model, requests, batch_size, pad_id))
        logger.info("%s: %.1f output tok/s", runs[-1].name, runs[-1].output_tokens_per_s)
    if options.hf_continuous and hf_continuous_batching_available(model):
        try:
            runs.append(run_hf_continuous(model, requests))
        except (RuntimeError, TimeoutError) as exc:
            logger.warning("HF continuous batching failed: %s", exc)
    elif options.hf_continuous:
        logger.warning("this transformers has no continuous batching; skipped")
    return runs


def _ratios(ours: RunResult, others: list[RunResult]) -> dict:
    """pagestream / baseline per metric, against the best static batch and HF CB."""
    static = [r for r in others if r.name.startswith("HF generate")]
    continuous = [r for r in others if "continuous" in r.name]
    ratios: dict = {}
    if static:
        best = max(static, key=lambda r: r.output_tokens_per_s)
        ratios["vs_hf_static_best"] = _ratio_entry(ours, best)
    if continuous:
        ratios["vs_hf_continuous"] = _ratio_entry(ours, continuous[0])
    return ratios


def _llamacpp_ratios(runs: list[RunResult]) -> dict:
    """pagestream / the fastest llama.cpp run in the same dtype (over its sequence counts)."""
    ratios = {}
    for ggml, torch_dtype in (("F32", "float32"), ("BF16", "bfloat16")):
        ours = [r for r in runs if r.name == f"pagestream LLM.generate ({torch_dtype})"]
        theirs = [r for r in runs if r.name.startswith(f"llama.cpp {ggml} ")]
        if ours and theirs:
            best = max(theirs, key=lambda r: r.output_tokens_per_s)
            ratios[f"vs_llamacpp_{ggml.lower()}"] = {
                **_ratio_entry(ours[0], best),
                "ours": ours[0].name,
            }
    return ratios


def _ratio_entry(ours: RunResult, other: RunResult) -> dict:
    return {
        "baseline": other.name,
        "requests_per_s": round(ours.requests_per_s / other.requests_per_s, 2),
        "output_tokens_per_s": round(ours.output_tokens_per_s / other.output_tokens_per_s, 2),
        "total_tokens_per_s": round(ours.total_tokens_per_s / other.total_tokens_per_s, 2),
    }
