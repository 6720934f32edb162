"""A quantized KV cache at a long context: batch-1 decode tok/s with `--kv-cache-dtype q8_0`
against a bfloat16 KV cache, on a 1.5B-shaped Q4_K_M file, and each side's KV bytes per
token (issue 52's target: q8_0 decode >= 10% faster, its bytes per token about halved).

    python -m benchmarks.kv_quant --out kv_quant_results.json [--llama-server PATH]
    # the model: $PAGESTREAM_CACHE/full_size/qwen2.5-1.5b.random-Q4_K_M.gguf
    # (benchmarks.random_gguf, made once); --context 512 --decode-tokens 8: a quick look

Each side of each round is a fresh process: an LLM on the file with that KV dtype, one
prompt of --context random token ids (prefilled once), then --decode-tokens greedy tokens
(ignore_eos); only the decode is timed: from its first token to its last. The sides take
turns going first. The baseline is bfloat16 named explicitly (auto is float32 on a CPU
without native bf16). With --llama-server, llama.cpp's own f16 against q8_0 KV decode rate
at the same depth (its /completion timings; flash attention on, which its quantized V cache
needs), for reference.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.child_call import child_call
from benchmarks.load_clients import ChildServer, free_port, http_healthy
from benchmarks.results import first_difference, median, ratio
from benchmarks.run_header import run_main
from benchmarks.timed_stream import post_json

logger = logging.getLogger(__name__)

SHAPE = "qwen2.5-1.5b"  # benchmarks.full_size's shape of the default file
BASELINE, QUANTIZED = "bfloat16", "q8_0"
SPEEDUP_TARGET = 1.10  # q8_0's decode tok/s over bf16's
# q8_0 keeps 32 int8 values and one fp16 scale (34 bytes) where bf16 keeps 64 bytes: 0.53.
BYTES_TARGET = 0.55
COMPARED_TOKENS = 16  # of each side's greedy decode, compared between the sides
FIRST_ID = 3  # the random files' byte tokens follow <unk>, <s>, </s>
# llama.cpp's nearest KV type to each of ours
LLAMA_KV = {"bfloat16": "f16", "float16": "f16", "float32": "f32", "q8_0": "q8_0"}


@dataclass(frozen=True)
class KvQuantOptions:
    model: str | None = None  # None: the random 1.5B-shaped Q4_K_M file
    context: int = 16000
    decode_tokens: int = 64
    rounds: int = 2
    threads: int = 2
    kv_cache_memory: str = "2GiB"
    seed: int = 0
    llama_server: str | None = None
    kv_dtypes: tuple[str, str] = (BASELINE, QUANTIZED)  # (the baseline, the one compared)

    def __post_init__(self) -> None:
        if len(self.kv_dtypes) != 2 or len(set(self.kv_dtypes)) != 2:
            raise ValueError(f"kv_dtypes must be two different dtypes, got {self.kv_dtypes!r}.")
        if min(self.rounds, self.threads, self.context) < 1:
            raise ValueError("rounds, threads and context must be >= 1.")
        if self.decode_tokens < 2:
            raise ValueError(
                f"decode_tokens must be >= 2 (one timed gap), got {self.decode_tokens}."
            )


def check_kv_dtype(kv_dtype: str) -> None:
    """ValueError where this build has no such KV cache dtype."""
    from services.common.config import CacheConfig

    try:
        CacheConfig(cache_dtype=kv_dtype)
    except ValueError as exc:
        raise ValueError(f"--kv-cache-dtype {kv_dtype} not supported by this build: {exc}") from exc


def context_ids(length: int, vocab_size: int, seed: int) -> list[int]:
    """`length` seeded random token ids among the byte tokens (below the vocabulary)."""
    high = min(vocab_size, FIRST_ID + 256)
    return np.random.default_rng(seed).integers(FIRST_ID, high, length).tolist()


def token_times(
    engine, prompt_ids: list[int], max_tokens: int
) -> tuple[list[float], list[int], int]:
    """Stream one greedy request (ignore_eos) through `engine` (an LLMEngine): each output
    token's arrival (perf_counter, one per token), the tokens, and the prompt tokens the
    prefix cache (or an offload tier) gave it."""
    from services.common.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    engine.add_request(None, {"prompt_token_ids": prompt_ids}, params)
    times: list[float] = []
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            new = output.outputs[0].token_ids
            times += [time.perf_counter()] * len(new)
            tokens += new
            cached = max(cached, output.num_cached_tokens)
    return times, tokens, cached


def decode_run(
    model: str, kv_dtype: str, context: int, decode_tokens: int, kv_cache_memory: str, seed: int
) -> dict:
    """One side of one round (run in its own process): prefill `context` tokens, decode
    `decode_tokens`; the decode rate between the first and last token, the KV bytes per
    token the engine's cache holds."""
    from pagestream import LLM

    llm = LLM(
        model,
        kv_cache_dtype=kv_dtype,
        max_model_len=context + decode_tokens,
        kv_cache_memory=kv_cache_memory,
        max_num_seqs=1,
    )
    engine = llm.engine
    ids = context_ids(context, engine.model_info.vocab_size, seed)
    start = time.perf_counter()
    times, tokens, _ = token_times(engine, ids, decode_tokens)
    cache, worker = engine.cache_info, engine.worker
    engine.close()
    if len(tokens) != decode_tokens:
        raise RuntimeError(f"{decode_tokens} tokens asked, {len(tokens)} generated")
    decode_s = times[-1] - times[0]
    return {
        "kv_dtype": kv_dtype,
        "kv_dtype_resolved": str(worker.kv_cache_spec.dtype) if worker is not None else None,
        "kv_bytes_per_token": cache.bytes_per_block // cache.block_size,
        "prefill_s": round(times[0] - start, 3),
        "decode_s": round(decode_s, 3),
        "decode_tok_s": round((decode_tokens - 1) / decode_s, 3),
        "tokens": tokens[:COMPARED_TOKENS],
    }


# ---- llama.cpp's figure ----------------------------------------------------------------------
@dataclass
class LlamaServer(ChildServer):
    """llama-server on `model`, one slot of `context` tokens, the KV cache in `kv_type`."""

    binary: str
    model: str
    kv_type: str
    context: int
    threads: int
    port: int = field(default_factory=free_port)
    startup_timeout_s: float = 600.0
    quiet = True
    what = "llama-server"

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        return http_healthy(f"{self.url}/health")

    def command(self) -> list[str]:
        threads = str(self.threads)
        return [
            self.binary,
            *("-m", self.model, "-c", str(self.context), "-np", "1", "-fa", "on"),
            *("-ctk", self.kv_type, "-ctv", self.kv_type, "-t", threads, "-tb", threads),
            *("--host", "127.0.0.1", "--port", str(self.port), "--no-webui"),
        ]


def llama_decode(options: KvQuantOptions, model: str, kv_dtype: str) -> dict:
    """llama.cpp's decode rate after the same prompt: /completion's own timings."""
    kv_type = LLAMA_KV[kv_dtype]
    total = options.context + options.decode_tokens
    body = {
        "prompt": context_ids(options.context, 1 << 30, options.seed),
        "n_predict": options.decode_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    with LlamaServer(options.llama_server, model, kv_type, total, options.threads) as server:
        timings = post_json(server.url, "/completion", body)["timings"]
    return {
        "kv_type": kv_type,
        "prefill_s": round(timings["prompt_ms"] / 1e3, 3),
        "decode_tok_s": round(timings["predicted_per_second"], 3),
    }


# ---- the run -------------------------------------------------------------------------------
def default_model() -> str:
    from benchmarks.random_gguf import random_gguf

    return str(random_gguf(SHAPE))


def _order(kv_dtypes: tuple[str, ...], index: int) -> list[str]:
    """The sides' order in round `index`: each goes first every other round."""
    return list(kv_dtypes) if index % 2 == 0 else list(kv_dtypes)[::-1]


def summarize(rounds: dict[str, list[dict]]) -> dict:
    """Per side the medians over its rounds; the ratios of the second side (q8_0) over the
    first (the baseline), and the targets."""
    sides = {
        kv: {
            "decode_tok_s": median(r["decode_tok_s"] for r in runs),
            "prefill_s": median(r["prefill_s"] for r in runs),
            "kv_bytes_per_token": runs[0]["kv_bytes_per_token"],
            "kv_dtype_resolved": runs[0]["kv_dtype_resolved"],
            "rounds": runs,
        }
        for kv, runs in rounds.items()
    }
    base, quant = sides.values()
    speedup = ratio(quant["decode_tok_s"], base["decode_tok_s"])
    bytes_ratio = ratio(quant["kv_bytes_per_token"], base["kv_bytes_per_token"])
    first = [runs[0]["tokens"] for runs in rounds.values()]
    return {
        "sides": sides,
        "decode_speedup": speedup,
        "kv_bytes_ratio": bytes_ratio,
        "greedy_common_tokens": first_difference(*first),
        "targets_met": {
            f"decode_speedup >= {SPEEDUP_TARGET}": speedup is not None
            and speedup >= SPEEDUP_TARGET,
            f"kv_bytes_ratio <= {BYTES_TARGET}": bytes_ratio is not None
            and bytes_ratio <= BYTES_TARGET,
        },
    }


def run_kv_quant(options: KvQuantOptions) -> dict:
    """Every round's sides in fresh processes, alternating; llama.cpp's pair when asked."""
    for kv_dtype in options.kv_dtypes:
        check_kv_dtype(kv_dtype)
    model = options.model or default_model()
    rounds: dict[str, list[dict]] = {kv: [] for kv in options.kv_dtypes}
    for index in range(options.rounds):
        for kv_dtype in _order(options.kv_dtypes, index):
            run = child_call(
                "benchmarks.kv_quant:decode_run",
                options.threads,
                model=model,
                kv_dtype=kv_dtype,
                context=options.context,
                decode_tokens=options.decode_tokens,
                kv_cache_memory=options.kv_cache_memory,
                seed=options.seed,
            )
            logger.info("round %d %s: %s", index, kv_dtype, run)
            rounds[kv_dtype].append(run)
    result = {"model": model, "context": options.context, "decode_tokens": options.decode_tokens}
    result |= summarize(rounds)
    if options.llama_server:
        peer = {kv: llama_decode(options, model, kv) for kv in options.kv_dtypes}
        base, quant = (peer[kv]["decode_tok_s"] for kv in options.kv_dtypes)
        peer["decode_speedup"] = ratio(quant, base)
        result["llama_cpp"] = peer
    return result


def parse_options(argv: list[str]) -> tuple[KvQuantOptions, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF file or HF folder (default: the random 1.5B)")
    parser.add_argument("--context", type=int, default=16000, help="prompt tokens")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded after it")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side")
    parser.add_argument("--threads", type=int, default=2, help="every side's threads")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="each side's KV cache")
    parser.add_argument("--seed", type=int, default=0, help="the prompt's seed")
    parser.add_argument(
        "--kv-dtypes", default=f"{BASELINE},{QUANTIZED}", help="the baseline,the compared"
    )
    parser.add_argument("--llama-server", help="llama.cpp's f16 / q8_0 KV decode rate too")
    parser.add_argument("--out", type=Path, help="write the results (JSON) here")
    args = parser.parse_args(argv)
    options = KvQuantOptions(
        model=args.model,
        context=args.context,
        decode_tokens=args.decode_tokens,
        rounds=args.rounds,
        threads=args.threads,
        kv_cache_memory=args.kv_cache_memory,
        seed=args.seed,
        llama_server=args.llama_server,
        kv_dtypes=tuple(args.kv_dtypes.split(",")),
    )
    return options, args.out


def _summary(result: dict) -> dict:
    return {k: result[k] for k in ("decode_speedup", "kv_bytes_ratio", "targets_met")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_main("benchmarks.kv_quant", argv, parse_options, run_kv_quant, _summary)


if __name__ == "__main__":
    raise SystemExit(main())
