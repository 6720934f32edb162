"""Online serving: Poisson arrivals against a running `pagestream serve`, over HTTP and gRPC.

For each request rate the same requests arrive with seeded exponential gaps (rate ``inf``
sends them all at once: the server's saturated throughput); the server runs without prefix
caching, so no run gets hits from the prompts of an earlier one. Each run reports TTFT, TPOT and
ITL (p50 / p99, milliseconds), output throughput and failures. The same runs against
``--split-services`` (worker, scheduler and frontend as three processes over loopback gRPC)
give the cost of the split as ratios.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.load_clients import GrpcClient, HttpClient, RequestRecord
from benchmarks.results import median, percentiles, ratio
from benchmarks.server_process import ServerProcess
from benchmarks.workload import BenchRequest, totals

logger = logging.getLogger(__name__)

INF = math.inf


@dataclass
class ServingOptions:
    model: str
    rates: tuple[float, ...] = (1.0, 4.0)
    transports: tuple[str, ...] = ("http", "grpc")
    split_services: bool = True
    split_transports: tuple[str, ...] = ("grpc",)
    seed: int = 0
    # Every run sends the same prompts, so the prefix cache is off: otherwise every run after
    # the first would measure prefix hits instead of prefills.
    engine_flags: tuple[str, ...] = ("--kv-cache-memory", "1GiB", "--no-enable-prefix-caching")


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent (Poisson process)."""
    if rate == INF:
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


async def run_load(client, requests: list[BenchRequest], rate: float, seed: int) -> dict:
    """Send every request at its arrival time; summarise once all have finished."""
    offsets = arrival_offsets(len(requests), rate, seed)
    start = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))  # the schedule
        return await client.send(request)

    records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    return {
        "rate": "inf" if rate == INF else rate,
        **summarize(records, time.perf_counter() - start),
    }


def summarize(records: list[RequestRecord], duration_s: float, **percentile_options) -> dict:
    """The serving summary of a load's requests: counts, throughput, TTFT, TPOT and ITL
    percentiles in ms (results.percentiles' options: p50 / p99 unless told)."""

    def ms(seconds) -> dict:
        return percentiles(seconds, scale=1e3, **percentile_options)

    ok = [r for r in records if r.ok]
    failures = [
        r.error or f"{r.output_tokens} of {r.expected_tokens} tokens" for r in records if not r.ok
    ]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failures": len(failures),
        "failure_examples": failures[:3],
        "duration_s": round(duration_s, 2),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / duration_s, 2),
        "ttft_ms": ms(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": ms(r.tpot for r in ok if r.tpot is not None),
        "itl_ms": ms(gap for r in ok for gap in r.itls),
    }


async def _run_transport(server: ServerProcess, transport: str, requests, rates, seed) -> list:
    client = HttpClient(server.http_url) if transport == "http" else GrpcClient(server.grpc_address)
    results = []
    async with client:
        await client.send(requests[0])  # warm-up (first-request costs)
        for rate in rates:
            result = await run_load(client, requests, rate, seed)
            result["transport"] = client.name
            results.append(result)
            logger.info(
                "%s rate %s: %.1f output tok/s, TTFT p50 %s ms, %d failures",
                client.name,
                result["rate"],
                result["output_tokens_per_s"],
                result["ttft_ms"]["p50"],
                result["failures"],
            )
    return results


def _serve_runs(options: ServingOptions, split: bool, transports, rates, requests) -> list[dict]:
    server = ServerProcess(options.model, split_services=split, engine_flags=options.engine_flags)
    with server:
        runs = []
        for transport in transports:
            runs += asyncio.run(_run_transport(server, transport, requests, rates, options.seed))
    for run in runs:
        run["deployment"] = "split services" if split else "one process"
    return runs


def run_serving(requests: list[BenchRequest], options: ServingOptions) -> dict:
    """All rates over each transport against one process, then the split comparison."""
    finite = tuple(r for r in options.rates if r != INF)
    rates = (*finite, INF)  # saturation always runs, once
    runs = _serve_runs(options, False, options.transports, rates, requests)
    split_runs: list[dict] = []
    if options.split_services:
        split_rates = (max(finite), INF) if finite else (INF,)
        split_runs = _serve_runs(options, True, options.split_transports, split_rates, requests)
    return {
        "runs": runs + split_runs,
        "split_ratios": split_ratios(runs, split_runs),
        **totals(requests),
    }


def split_ratios(one: list[dict], split: list[dict]) -> list[dict]:
    """split / one process, per (transport, rate) measured both ways."""
    by_key = {(r["transport"], r["rate"]): r for r in one}
    ratios = []
    for run in split:
        base = by_key.get((run["transport"], run["rate"]))
        if base is None or not base["output_tokens_per_s"]:
            continue
        ratios.append(
            {
                "transport": run["transport"],
                "rate": run["rate"],
                "throughput": round(run["output_tokens_per_s"] / base["output_tokens_per_s"], 3),
                "ttft_p50": ratio(run["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
                "tpot_p50": ratio(run["tpot_ms"]["p50"], base["tpot_ms"]["p50"]),
            }
        )
    return ratios


# ---- async scheduling on vs off ----------------------------------------------------------


@dataclass
class AsyncServingOptions:
    model: str
    rates: tuple[float, ...] = (INF,)
    deployments: tuple[bool, ...] = (False, True)  # split services?
    transport: str = "grpc"
    rounds: int = 2
    seed: int = 0
    kv_cache_memory: str | int | None = None  # None: sized to the requests
    engine_flags: tuple[str, ...] = ("--no-enable-prefix-caching", "--dtype", "float32")


def run_async_serving(requests: list[BenchRequest], options: AsyncServingOptions) -> dict:
    """Per deployment, a server with `--async-scheduling` and one without stay up side by
    side and take turns, round after round, at every rate; ratios on / off per round."""
    from benchmarks.parallel import kv_cache_bytes

    rates = (*(r for r in options.rates if r != INF), INF)
    kv = options.kv_cache_memory or kv_cache_bytes(options.model, requests)
    flags = ("--kv-cache-memory", str(kv), *options.engine_flags)
    runs: list[dict] = []
    for split in options.deployments:
        servers = {
            on: ServerProcess(
                options.model,
                split_services=split,
                engine_flags=(*flags, *(("--async-scheduling",) if on else ())),
            )
            for on in (False, True)
        }
        with servers[False], servers[True]:
            for round_index in range(options.rounds):
                for on, server in servers.items():
                    for run in asyncio.run(
                        _run_transport(server, options.transport, requests, rates, options.seed)
                    ):
                        run.update(
                            deployment="split services" if split else "one process",
                            async_scheduling=on,
                            round=round_index,
                        )
                        runs.append(run)
    return {
        "runs": runs,
        "ratios": async_ratios(runs),
        "rounds": options.rounds,
        **totals(requests),
    }


def async_ratios(runs: list[dict]) -> list[dict]:
    """on / off per (deployment, rate): the median over rounds of each round's ratio, and
    the ratio of the bests (highest throughput, lowest latencies over the rounds), which a
    shared machine's other jobs disturb least: they only ever slow a run down."""
    by_key: dict[tuple, dict] = {}
    for run in runs:
        by_key.setdefault((run["deployment"], run["rate"]), {}).setdefault(
            run["async_scheduling"], {}
        )[run["round"]] = run
    ratios = []
    for (deployment, rate), modes in by_key.items():
        on, off = modes.get(True, {}), modes.get(False, {})
        rounds = sorted(set(on) & set(off))
        if not rounds:
            continue
        entry = {"deployment": deployment, "rate": rate, "rounds": len(rounds)}
        for name, metric, best in (
            ("throughput", lambda r: r["output_tokens_per_s"], max),
            ("ttft_p50", lambda r: r["ttft_ms"]["p50"], min),
            ("tpot_p50", lambda r: r["tpot_ms"]["p50"], min),
        ):
            per_round = [ratio(metric(on[i]), metric(off[i])) for i in rounds]
            entry[name] = median(per_round)
            entry[f"{name}_best"] = ratio(
                _best([metric(on[i]) for i in rounds], best),
                _best([metric(off[i]) for i in rounds], best),
            )
        ratios.append(entry)
    return ratios


def _best(values: list[float | None], best) -> float | None:
    present = [v for v in values if v is not None]
    return best(present) if present else None
