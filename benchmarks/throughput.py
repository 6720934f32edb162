"""Offline throughput: pagestream ``LLM.generate`` against HF ``generate`` (static padded
batches), HF continuous batching and, when asked, llama.cpp, on the same prompt ids and output
lengths (no early stop), with each run's fraction of the matmul ceiling (ceiling.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from benchmarks.ceiling import ModelShapes, measure_matmul_ceiling, workload_flops
from benchmarks.llamacpp import LlamaCppOptions, check_requests, run_llamacpp_section
from benchmarks.offline import make_llm, run_pagestream, token_ids
from benchmarks.results import RunResult
from benchmarks.workload import BenchRequest, greedy_inputs

logger = logging.getLogger(__name__)
METRICS = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
CB_TIMEOUT_S = 3600  # HF continuous batching's whole run


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
    runs = [ours, *_run_hf(folder, requests, options)]
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


def _run_hf(folder: str, requests: list[BenchRequest], options: ThroughputOptions) -> list:
    """A static batch run per size, then continuous batching where this transformers has it."""
    from transformers import AutoModelForCausalLM

    continuous = options.hf_continuous
    if not options.hf_batch_sizes and not continuous:
        return []
    dtype = getattr(torch, options.dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    pad_id = model.generation_config.pad_token_id or 0
    runs = [_hf_static(model, requests, size, pad_id) for size in options.hf_batch_sizes]
    if continuous and not hasattr(model, "continuous_batching_context_manager"):
        logger.warning("this transformers has no continuous batching; skipped")
    elif continuous:
        try:
            runs.append(_hf_continuous(model, requests))
        except (RuntimeError, TimeoutError) as exc:
            logger.warning("HF continuous batching failed: %s", exc)
    return runs


def _hf_static(model, requests: list[BenchRequest], batch_size: int, pad_id: int) -> RunResult:
    """HF ``generate`` over consecutive left-padded batches of ``batch_size``."""
    start, generated = time.perf_counter(), 0
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width, steps = max(r.prompt_len for r in batch), max(r.output_len for r in batch)
        rows = [[pad_id] * (width - r.prompt_len) + list(r.prompt_token_ids) for r in batch]
        masks = [[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch]
        ids, mask = torch.tensor(rows), torch.tensor(masks)
        lengths = {"max_new_tokens": steps, "min_new_tokens": steps, "pad_token_id": pad_id}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **lengths)
        generated += (out.shape[1] - ids.shape[1]) * out.shape[0]
    elapsed = time.perf_counter() - start
    run = RunResult.of(
        f"HF generate, static batch {batch_size}",
        requests,
        elapsed,
        generated=generated,
        output_tokens=sum(r.output_len for r in requests),
        extra={"batch_size": batch_size},
    )
    logger.info("%s: %.1f output tok/s", run.name, run.output_tokens_per_s)
    return run


def _hf_continuous(model, requests: list[BenchRequest]) -> RunResult:
    """HF's continuous-batching manager, built and warmed up before the clock starts."""
    from transformers import GenerationConfig

    longest = max(r.output_len for r in requests)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=longest, eos_token_id=-1, pad_token_id=0
    )
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level, results = cb_logger.level, {}
    cb_logger.setLevel(logging.CRITICAL)  # it logs an error when psutil is missing
    try:
        with model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=30
        ) as manager:
            start = time.perf_counter()
            for r in requests:
                manager.add_request(
                    r.prompt_token_ids, max_new_tokens=r.output_len, eos_token_id=-1
                )
            while len(results) < len(requests):
                if time.perf_counter() > start + CB_TIMEOUT_S:
                    raise TimeoutError("HF continuous batching timed out")
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped early")
            elapsed = time.perf_counter() - start
    finally:
        cb_logger.setLevel(level)
    generated = sum(len(r.generated_tokens) for r in results.values())
    name, extra = "HF continuous batching (generate_batch)", {"completed": len(results)}
    return RunResult.of(name, requests, elapsed, generated=generated, extra=extra)


def _ceiling(shapes: ModelShapes, flops: dict, dtype: str, runs: list[RunResult]) -> dict:
    """The matmul ceiling in `dtype` and the fraction of it each run of that dtype reached."""
    ceiling = measure_matmul_ceiling(shapes, dtype=getattr(torch, dtype))
    bf16, bound_s = dtype == "bfloat16", flops["total"] / (ceiling.gflops * 1e9)
    same_dtype = [r for r in runs if ("bfloat16" in r.name or "BF16" in r.name) == bf16]
    return {
        **asdict(ceiling),
        "gflops": round(ceiling.gflops, 1),
        "workload_gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
        "flop_bound_s": round(bound_s, 2),
        "fraction": {r.name: float(f"{bound_s / r.elapsed_s:.3g}") for r in same_dtype},
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
