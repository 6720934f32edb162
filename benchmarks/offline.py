"""The offline driver: an engine, a warm-up that leaves the prefix cache empty, then
`LLM.generate` timed over a workload."""

from __future__ import annotations

import time

from benchmarks.kv_utilization import KVUtilizationSampler
from benchmarks.results import RunResult
from benchmarks.workload import BenchRequest, greedy_inputs


def make_llm(model: str, dtype: str = "float32", kv_cache_memory="2GiB", **engine_kwargs):
    from pagestream import LLM

    return LLM(model, dtype=dtype, kv_cache_memory=kv_cache_memory, **engine_kwargs)


def warm_up(llm, request: BenchRequest) -> None:
    """Two short greedy requests, then an empty prefix cache (no prefix hit for the timed run)."""
    llm.generate(*greedy_inputs([BenchRequest(request.prompt_token_ids[:16], 4)] * 2), False)
    llm.engine.scheduler.kv.reset_prefix_cache()


def timed_generate(llm, prompts: list[dict], params, **kwargs) -> tuple[float, list]:
    """(seconds, outputs) of one `LLM.generate` (kwargs: its lora_request)."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    return time.perf_counter() - start, outputs


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_pagestream(llm, requests: list[BenchRequest], name: str = "pagestream") -> RunResult:
    """LLM.generate over the workload (after a warm-up); KV use sampled every step."""
    warm_up(llm, requests[0])
    sampler = KVUtilizationSampler(llm.engine, requests)
    with sampler.attached():
        elapsed, outputs = timed_generate(llm, *greedy_inputs(requests))
    tokens = token_ids(outputs)
    return RunResult.of(
        name,
        requests,
        elapsed - sampler.overhead_s,
        generated=sum(map(len, tokens)),
        extra={
            "num_cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            "num_steps": sampler.num_steps,
            "sampler_overhead_s": round(sampler.overhead_s, 3),
            "kv_utilization": sampler.summary(),
        },
        token_ids=tokens,
    )
