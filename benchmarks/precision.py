"""`pagestream bench precision`: bfloat16 against float32 on the CPU, side by side.

The profile's workload (its prompts and output lengths, greedy, ignore_eos) runs through
`LLM.generate` once per dtype per round, the dtypes in a rotated order each round; output
tokens/s are medians over the rounds. Greedy agreement compares each request's bf16 tokens
with its float32 tokens: how many are equal all the way, and where the first difference
falls (mean over requests, the output length when there is none).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from benchmarks.results import agreement
from benchmarks.workload import BenchRequest, greedy_inputs

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PrecisionOptions:
    model: str
    kv_cache_memory: str = "2GiB"
    rounds: int = 2


def _generate(llm, requests: list[BenchRequest]) -> tuple[float, list[list[int]]]:
    prompts, params = greedy_inputs(requests)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.engine.scheduler.kv.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outputs]


def run_precision(requests: list[BenchRequest], options: PrecisionOptions) -> dict:
    from pagestream import LLM

    speeds: dict[str, list[float]] = {d: [] for d in DTYPES}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(options.rounds):
        order = DTYPES if round_index % 2 == 0 else DTYPES[::-1]
        for dtype in order:
            llm = LLM(options.model, dtype=dtype, kv_cache_memory=options.kv_cache_memory)
            elapsed, got = _generate(llm, requests)
            del llm
            speeds[dtype].append(sum(len(t) for t in got) / elapsed)
            tokens.setdefault(dtype, got)
            logger.info("round %d %s: %.1f output tok/s", round_index, dtype, speeds[dtype][-1])
    tok_s = {d: round(statistics.median(v), 2) for d, v in speeds.items()}
    return {
        "requests": len(requests),
        "rounds": options.rounds,
        "output_tok_s": tok_s,
        "output_tok_s_per_round": {d: [round(x, 2) for x in v] for d, v in speeds.items()},
        "bf16_over_fp32": round(tok_s["bfloat16"] / tok_s["float32"], 3),
        "agreement": agreement(tokens["bfloat16"], tokens["float32"]),
    }
