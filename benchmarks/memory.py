"""Memory: KV-cache utilisation (kv_utilization.py), prefix caching on / off (TTFT from
admission, throughput) on a shared system prompt, and the peak KV blocks of n = 4 sampling and
beam width 4 against the same work as independent requests (prefix cache off)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from benchmarks.kv_utilization import KVUtilizationSampler
from benchmarks.offline import make_llm
from benchmarks.workload import BenchRequest, Profile, greedy_inputs, shared_prefix_workload


@dataclass
class MemoryOptions:
    model: str
    profile: Profile  # the sizes of the prefix-caching and sharing runs
    kv_cache_memory: str = "1GiB"
    sharing_width: int = 4


def _warm_llm(options: MemoryOptions, cache: bool):
    from pagestream import SamplingParams

    llm = make_llm(options.model, "auto", options.kv_cache_memory, enable_prefix_caching=cache)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
    return llm


def drive(llm, prompts: list[dict], params: list) -> tuple[float, list, int]:
    """Admit everything at once and step until done: (seconds, request states, peak blocks)."""
    engine, sampler = llm.engine, KVUtilizationSampler(llm.engine)
    start = time.perf_counter()
    states = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params, strict=True)]
    with sampler.attached():
        while engine.has_unfinished_requests():
            engine.step()
    return time.perf_counter() - start - sampler.overhead_s, states, sampler.peak_pool_blocks


def prefix_caching(options: MemoryOptions, tokenizer) -> dict:
    """TTFT and throughput on a shared-system-prompt workload, prefix cache on vs off."""
    p = options.profile
    sizes = (p.prefix_num_requests, p.system_prompt_len, p.question_len, p.prefix_output_len)
    requests = shared_prefix_workload(tokenizer, *sizes)
    total_tokens = sum(r.prompt_len + r.output_len for r in requests)
    result: dict = {
        "num_requests": len(requests),
        "system_prompt_len": p.system_prompt_len,
        "question_len": p.question_len,
        "output_len": p.prefix_output_len,
    }
    for enabled in (False, True):
        llm = _warm_llm(options, cache=enabled)
        elapsed, states, _ = drive(llm, *greedy_inputs(requests))
        del llm
        ttfts = [s.first_token_time - s.arrival_time for s in states if s.first_token_time]
        result["on" if enabled else "off"] = {
            "elapsed_s": round(elapsed, 3),
            "total_tokens_per_s": round(total_tokens / elapsed, 2),
            "ttft_mean_ms": round(statistics.fmean(ttfts) * 1e3, 1),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1),
            "cached_tokens": sum(s.num_cached_tokens for s in states),
        }
    off, on = result["off"], result["on"]
    result["speedup"] = round(on["total_tokens_per_s"] / off["total_tokens_per_s"], 2)
    result["ttft_ratio"] = round(on["ttft_mean_ms"] / off["ttft_mean_ms"], 3)
    return result


def sharing(options: MemoryOptions, requests: list[BenchRequest]) -> dict:
    """Peak blocks: n = width sampling and beam search vs width independent requests each."""
    from pagestream import SamplingParams

    width, length = options.sharing_width, options.profile.sharing_output_len
    chosen = requests[: options.profile.sharing_num_prompts]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in chosen]
    repeated = [p for p in prompts for _ in range(width)]
    llm = _warm_llm(options, cache=False)
    sample = SamplingParams(temperature=0.8, seed=0, max_tokens=length, ignore_eos=True)
    beam = SamplingParams(
        n=width, temperature=0.0, max_tokens=length, ignore_eos=True, use_beam_search=True
    )
    cases = {
        "parallel_sampling": (prompts, [sample.clone(n=width)] * len(prompts)),
        "beam_search": (prompts, [beam] * len(prompts)),
        "independent": (repeated, [sample.clone(seed=i) for i in range(len(repeated))]),
    }
    runs = {}
    for name, (case_prompts, params) in cases.items():
        elapsed, _, peak_blocks = drive(llm, case_prompts, params)
        runs[name] = {"peak_blocks": peak_blocks, "elapsed_s": round(elapsed, 3)}
    independent = runs["independent"]["peak_blocks"]
    for name in ("parallel_sampling", "beam_search"):
        runs[name]["saving_vs_independent"] = round(1 - runs[name]["peak_blocks"] / independent, 3)
    return {
        "num_prompts": len(chosen),
        "width": width,
        "output_len": length,
        "prompt_tokens": [r.prompt_len for r in chosen],
        **runs,
    }


def run_memory(
    requests: list[BenchRequest], options: MemoryOptions, kv_utilization: dict | None = None
) -> dict:
    """Everything above; ``kv_utilization`` from the throughput run when it already ran."""
    from transformers import AutoTokenizer

    from benchmarks.offline import run_pagestream
    from services.common.model_source import resolve_model

    if kv_utilization is None:
        llm = make_llm(options.model, "float32", options.kv_cache_memory)  # as HF's runs
        kv_utilization = run_pagestream(llm, requests).extra["kv_utilization"]
        del llm
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(options.model))
    return {
        "kv_utilization": kv_utilization,
        "prefix_caching": prefix_caching(options, tokenizer),
        "sharing": sharing(options, requests),
    }
