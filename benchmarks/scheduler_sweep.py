"""The CPU scheduler defaults, swept: token budget, sequence cap, long-prefill cap.

For each setting of (max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold):

- saturated throughput: ``LLM.generate`` over the whole workload at once (output tok/s);
- under load: an in-process ``AsyncEngine`` fed by ``concurrency`` closed-loop clients
  (a finished request is replaced at once, so prefills keep arriving while others decode),
  with every streamed token's arrival time: inter-token latency p50 / p99, TTFT p50 / p99.

A big budget lets one step carry a long prefill chunk, and every decoding request waits
for that whole step: the ITL tail. A small one splits prefills finely but runs the
decode batch's fixed costs (the weights stream through once per step) more often.

    .venv/bin/python -m benchmarks.scheduler_sweep [--settings 2048:256:0,512:256:0]
        [--dtype float32] [--num-requests 48] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time

from benchmarks.load_clients import RequestRecord, closed_loop
from benchmarks.offline import make_llm, run_pagestream
from benchmarks.results import percentiles
from benchmarks.workload import PROFILES, BenchRequest, make_workload
from services.common.config import DEFAULT_MODEL

DEFAULT_SETTINGS = (
    "2048:256:0",
    "1024:256:0",
    "512:256:0",
    "256:256:0",
    "2048:256:256",
    "1024:256:128",
    "512:128:0",
    "512:64:0",
)


def parse_setting(text: str) -> dict:
    budget, seqs, threshold = (int(x) for x in text.split(":"))
    return {
        "max_num_batched_tokens": budget,
        "max_num_seqs": seqs,
        "long_prefill_token_threshold": threshold,
    }


class EngineClient:
    """An in-process AsyncEngine as a load client (benchmarks/load_clients.py's send)."""

    def __init__(self, engine) -> None:
        self.engine, self.sent = engine, 0

    async def send(self, request: BenchRequest) -> RequestRecord:
        from pagestream import RequestOutputKind, SamplingParams

        params = SamplingParams(
            temperature=0,
            max_tokens=request.output_len,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        record = RequestRecord(sent=time.perf_counter(), expected_tokens=request.output_len)
        self.sent += 1
        prompt = {"prompt_token_ids": request.prompt_token_ids}
        async for out in self.engine.generate(prompt, params, f"sweep-{self.sent}"):
            if out.outputs and out.outputs[0].token_ids:
                record.token_times.append(time.perf_counter())
                record.output_tokens += len(out.outputs[0].token_ids)
        record.end = time.perf_counter()
        return record


async def _load_run(engine, requests: list[BenchRequest], concurrency: int) -> dict:
    try:
        records, elapsed = await closed_loop(EngineClient(engine), requests, concurrency)
    finally:
        await engine.shutdown()
    itl = percentiles((gap for r in records for gap in r.itls), scale=1e3)
    ttft = percentiles((r.ttft for r in records if r.ttft is not None), scale=1e3)
    return {
        "output_tokens_per_s": round(sum(r.output_tokens for r in records) / elapsed, 1),
        "itl_p50_ms": itl["p50"],
        "itl_p99_ms": itl["p99"],
        "ttft_p50_ms": ttft["p50"],
        "ttft_p99_ms": ttft["p99"],
        "requests": len(records),
    }


def run_setting(model: str, dtype: str, setting: dict, requests, load_requests, concurrency):
    from pagestream import AsyncEngine

    llm = make_llm(model, dtype, "2GiB", enable_prefix_caching=False, **setting)
    offline = run_pagestream(llm, requests)
    llm.engine.close()
    del llm
    gc.collect()
    engine = AsyncEngine.from_args(
        model, dtype=dtype, kv_cache_memory="2GiB", enable_prefix_caching=False, **setting
    )

    loaded = asyncio.run(_load_run(engine, load_requests, concurrency))
    del engine
    gc.collect()
    return {
        **setting,
        "offline_output_tokens_per_s": round(offline.output_tokens_per_s, 1),
        "load": loaded,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS))
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--load-output-scale", type=float, default=0.5)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    opts = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from services.worker.models.gguf_weights import dequantized_folder

    folder = str(dequantized_folder(opts.model))
    workload = make_workload(AutoTokenizer.from_pretrained(folder), PROFILES["quick"])
    requests = workload.requests[: opts.num_requests]
    load_requests = [
        BenchRequest(r.prompt_token_ids, max(2, round(r.output_len * opts.load_output_scale)))
        for r in requests
    ]
    rows = []
    print("budget seqs long_prefill | offline tok/s | load tok/s  ITL p50  ITL p99  TTFT p50 p99")
    for text in opts.settings.split(","):
        row = run_setting(
            folder, opts.dtype, parse_setting(text), requests, load_requests, opts.concurrency
        )
        rows.append(row)
        load = row["load"]
        print(
            f"{row['max_num_batched_tokens']:6d} {row['max_num_seqs']:4d} "
            f"{row['long_prefill_token_threshold']:12d} | "
            f"{row['offline_output_tokens_per_s']:13.1f}"
            f" | {load['output_tokens_per_s']:10.1f} {load['itl_p50_ms']:8.1f} "
            f"{load['itl_p99_ms']:8.1f} {load['ttft_p50_ms']:9.1f} {load['ttft_p99_ms']:7.1f}",
            flush=True,
        )
    best = max(r["offline_output_tokens_per_s"] for r in rows)
    for row in rows:
        row["offline_vs_best"] = round(row["offline_output_tokens_per_s"] / best, 3)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump({"command": " ".join(__import__("sys").argv), "rows": rows}, f, indent=1)
    print("offline vs best:", [r["offline_vs_best"] for r in rows])
    print("median ITL p99 ms:", statistics.median(r["load"]["itl_p99_ms"] for r in rows))


if __name__ == "__main__":
    main()
