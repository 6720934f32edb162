"""Offline throughput: pagestream ``LLM.generate`` against HF transformers on one workload.

Every engine runs the same prompt ids and output lengths (no early stop), one after the other:
pagestream (in each dtype asked), HF static batches and continuous batching
(benchmarks/hf_baselines.py), llama.cpp when asked (benchmarks/llamacpp.py); plus the matmul
ceiling at the model's shapes and each run's fraction of it (benchmarks/ceiling.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from benchmarks.ceiling import (
    ModelShapes,
    flop_bound_fraction,
    measure_matmul_ceiling,
    workload_flops,
)
from benchmarks.hf_baselines import run_hf_baselines
from benchmarks.llamacpp import LlamaCppOptions, check_requests, run_llamacpp_section
from benchmarks.offline import make_llm, run_pagestream, token_ids
from benchmarks.results import RunResult
from benchmarks.workload import BenchRequest, greedy_inputs

METRICS = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")


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
    reference, cpp = None, options.llamacpp

    def pagestream(dtype: str):
        llm = make_llm(folder, dtype, options.kv_cache_memory, **options.engine_kwargs)
        return llm, run_pagestream(llm, requests, f"pagestream LLM.generate ({dtype})")

    llm, ours = pagestream(options.dtype)
    shapes = ModelShapes.from_config(llm.engine.worker.model.config)
    if cpp is not None and options.dtype == "float32":
        checks = greedy_inputs(check_requests(requests, cpp))
        reference = token_ids(llm.generate(*checks, use_tqdm=False))
    del llm
    hf = (options.dtype, options.hf_batch_sizes, options.hf_continuous)
    runs = [ours, *run_hf_baselines(folder, requests, *hf)]
    runs += [pagestream(dtype)[1] for dtype in options.extra_dtypes]
    if cpp is not None:
        theirs, llamacpp_info = run_llamacpp_section(requests, cpp, reference, runs)
        runs += theirs
    flops = workload_flops(shapes, requests)
    result = {
        "runs": [r.as_dict() for r in runs],
        "ratios": {**_ratios(runs), **_llamacpp_ratios(runs)},
        "ceiling": _ceiling(shapes, flops, options.dtype, runs),
    }
    if "bfloat16" in options.extra_dtypes and options.dtype != "bfloat16":
        result["ceiling_bfloat16"] = _ceiling(shapes, flops, "bfloat16", runs)
    if cpp is not None:
        result["llamacpp"] = llamacpp_info
    return result


def _ceiling(shapes: ModelShapes, flops: dict, dtype: str, runs: list[RunResult]) -> dict:
    """The matmul ceiling in `dtype` and the fraction of it each run of that dtype reached."""
    ceiling = measure_matmul_ceiling(shapes, dtype=getattr(torch, dtype))
    bf16 = dtype == "bfloat16"
    same_dtype = [r for r in runs if ("bfloat16" in r.name or "BF16" in r.name) == bf16]
    return {
        **asdict(ceiling),
        "gflops": round(ceiling.gflops, 1),
        "workload_gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
        "flop_bound_s": round(flops["total"] / (ceiling.gflops * 1e9), 2),
        "fraction": {
            r.name: float(f"{flop_bound_fraction(flops['total'], r.elapsed_s, ceiling):.3g}")
            for r in same_dtype
        },
    }


def _ratios(runs: list[RunResult]) -> dict:
    """pagestream / the best HF static batch and HF continuous batching."""
    static = [r for r in runs if r.name.startswith("HF generate")]
    continuous = [r for r in runs if "continuous" in r.name][:1]
    pairs = (("vs_hf_static_best", static), ("vs_hf_continuous", continuous))
    return {key: _ratio_entry(runs[0], others) for key, others in pairs if others}


def _llamacpp_ratios(runs: list[RunResult]) -> dict:
    """pagestream / the fastest llama.cpp run in the same dtype (over its sequence counts)."""
    ratios = {}
    for ggml, torch_dtype in (("F32", "float32"), ("BF16", "bfloat16")):
        ours = [r for r in runs if r.name == f"pagestream LLM.generate ({torch_dtype})"]
        theirs = [r for r in runs if r.name.startswith(f"llama.cpp {ggml} ")]
        if ours and theirs:
            entry = {**_ratio_entry(ours[0], theirs), "ours": ours[0].name}
            ratios[f"vs_llamacpp_{ggml.lower()}"] = entry
    return ratios


def _ratio_entry(ours: RunResult, others: list[RunResult]) -> dict:
    """pagestream / the fastest of `others` (by output tokens/s), per metric."""
    best = max(others, key=lambda r: r.output_tokens_per_s)
    ratios = {m: round(getattr(ours, m) / getattr(best, m), 2) for m in METRICS}
    return {"baseline": best.name, **ratios}
