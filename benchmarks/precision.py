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
from dataclasses import dataclass

from benchmarks.offline import make_llm, timed_generate, token_ids, warm_up
from benchmarks.results import agreement, rotated
from benchmarks.workload import BenchRequest, greedy_inputs

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PrecisionOptions:
    model: str
    kv_cache_memory: str = "2GiB"
    rounds: int = 2


def run_precision(requests: list[BenchRequest], options: PrecisionOptions) -> dict:
    speeds: dict[str, list[float]] = {d: [] for d in DTYPES}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(options.rounds):
        for dtype in rotated(DTYPES, round_index):
            llm = make_llm(options.model, dtype, options.kv_cache_memory)
            warm_up(llm, requests[0])
            elapsed, outputs = timed_generate(llm, *greedy_inputs(requests))
            got = token_ids(outputs)
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
