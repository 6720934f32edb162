"""Memory: KV-cache utilisation, prefix caching on/off, and sharing (n = 4, beam width 4).

- KV utilisation: pagestream's run over the profile workload, sampled every step, against a
  preallocate-max-length baseline on the same live requests (benchmarks/kv_utilization.py).
- Prefix caching: requests sharing one long system prompt, run with the prefix cache on and
  off: time to first token (from admission, all requests admitted at once) and throughput.
- Sharing: n = 4 parallel sampling and beam search of width 4 against the same work as
  independent requests (each prompt sent 4 times); peak KV blocks in use. The prefix cache is
  off in these runs, so the independent requests share nothing.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from benchmarks.kv_utilization import KVUtilizationSampler
from benchmarks.offline import make_llm
from benchmarks.workload import BenchRequest, Profile, greedy_inputs, shared_prefix_workload

logger = logging.getLogger(__name__)


@dataclass
class MemoryOptions:
    model: str
    profile: Profile  # the sizes of the prefix-caching and sharing runs
    kv_cache_memory: str = "1GiB"
    sharing_width: int = 4


def drive(llm, prompts: list[dict], params: list) -> dict:
    """Admit everything at once and step until done: elapsed, TTFTs and KV samples."""
    engine = llm.engine
    sampler = KVUtilizationSampler(engine)
    start = time.perf_counter()
    states = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params, strict=True)]
    with sampler.attached():
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.perf_counter() - start - sampler.overhead_s
    ttfts = [s.first_token_time - s.arrival_time for s in states if s.first_token_time]
    return {"elapsed_s": elapsed, "ttfts": ttfts, "sampler": sampler, "states": states}


def _warm(llm) -> None:
    from pagestream import SamplingParams

    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)


def prefix_caching(options: MemoryOptions, tokenizer) -> dict:
    """TTFT and throughput on a shared-system-prompt workload, prefix cache on vs off."""
    profile = options.profile
    requests = shared_prefix_workload(
        tokenizer,
        profile.prefix_num_requests,
        profile.system_prompt_len,
        profile.question_len,
        profile.prefix_output_len,
    )
    prompts, params = greedy_inputs(requests)
    total_tokens = sum(r.prompt_len + r.output_len for r in requests)
    result: dict = {
        "num_requests": len(requests),
        "system_prompt_len": profile.system_prompt_len,
        "question_len": profile.question_len,
        "output_len": profile.prefix_output_len,
    }
    for enabled in (False, True):
        llm = make_llm(
            options.model, "auto", options.kv_cache_memory, enable_prefix_caching=enabled
        )
        _warm(llm)
        run = drive(llm, prompts, params)
        result["on" if enabled else "off"] = {
            "elapsed_s": round(run["elapsed_s"], 3),
            "total_tokens_per_s": round(total_tokens / run["elapsed_s"], 2),
            "ttft_mean_ms": round(statistics.fmean(run["ttfts"]) * 1e3, 1),
            "ttft_p50_ms": round(statistics.median(run["ttfts"]) * 1e3, 1),
            "cached_tokens": sum(s.num_cached_tokens for s in run["states"]),
        }
        del llm
    off, on = result["off"], result["on"]
    result["speedup"] = round(on["total_tokens_per_s"] / off["total_tokens_per_s"], 2)
    result["ttft_ratio"] = round(on["ttft_mean_ms"] / off["ttft_mean_ms"], 3)
    return result


def _peak_blocks(llm, prompts: list[dict], params: list) -> dict:
    run = drive(llm, prompts, params)
    sampler: KVUtilizationSampler = run["sampler"]
    return {"peak_blocks": sampler.peak_pool_blocks, "elapsed_s": round(run["elapsed_s"], 3)}


def sharing(options: MemoryOptions, requests: list[BenchRequest]) -> dict:
    """Peak blocks: n = width sampling and beam search vs width independent requests each."""
    from pagestream import SamplingParams

    width, length = options.sharing_width, options.profile.sharing_output_len
    chosen = requests[: options.profile.sharing_num_prompts]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in chosen]
    repeated = [p for p in prompts for _ in range(width)]
    llm = make_llm(options.model, "auto", options.kv_cache_memory, enable_prefix_caching=False)
    _warm(llm)
    sample = SamplingParams(temperature=0.8, seed=0, max_tokens=length, ignore_eos=True)
    beam = SamplingParams(
        n=width, temperature=0.0, max_tokens=length, ignore_eos=True, use_beam_search=True
    )
    single = [sample.clone(seed=i) for i in range(len(repeated))]
    runs = {
        "parallel_sampling": _peak_blocks(llm, prompts, [sample.clone(n=width)] * len(prompts)),
        "beam_search": _peak_blocks(llm, prompts, [beam] * len(prompts)),
        "independent": _peak_blocks(llm, repeated, single),
    }
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

    from services.common.model_source import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(options.model))
    if kv_utilization is None:
        from benchmarks.offline import run_pagestream

        llm = make_llm(options.model, "float32", options.kv_cache_memory)  # as HF's runs
        kv_utilization = run_pagestream(llm, requests).extra["kv_utilization"]
        del llm
    return {
        "kv_utilization": kv_utilization,
        "prefix_caching": prefix_caching(options, tokenizer),
        "sharing": sharing(options, requests),
    }
