"""Online serving: Poisson arrivals against a running `pagestream serve`, over HTTP and gRPC,
per request rate (inf: all at once), against one process and `--split-services`; and async
scheduling on vs off (run_async_serving). Prefix caching off: every run sends the same prompts."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from benchmarks.load_clients import ServerProcess, figure, send_all, summarize
from benchmarks.results import median, ratio
from benchmarks.workload import BenchRequest, totals

logger = logging.getLogger(__name__)

INF = math.inf
METRICS = (  # (ratio name, the figure, the best of several rounds)
    ("throughput", "output_tokens_per_s", max),
    ("ttft_p50", "ttft_ms.p50", min),
    ("tpot_p50", "tpot_ms.p50", min),
)


@dataclass
class ServingOptions:
    model: str
    rates: tuple[float, ...] = (1.0, 4.0)
    transports: tuple[str, ...] = ("http", "grpc")
    split_services: bool = True
    split_transports: tuple[str, ...] = ("grpc",)
    seed: int = 0
    engine_flags: tuple[str, ...] = ("--kv-cache-memory", "1GiB", "--no-enable-prefix-caching")


def _load_runs(server: ServerProcess, transports, requests, rates, seed, **tags) -> list[dict]:
    """Every transport at every rate on a running server (after a warm-up request each)."""
    deployment = "split services" if server.split_services else "one process"

    async def runs(transport: str) -> list[dict]:
        found = []
        async with server.client(transport) as client:
            await client.send(requests[0])  # first-request costs
            for rate in rates:
                records, duration = await send_all(client, requests, rate=rate, seed=seed)
                run = {"rate": "inf" if rate == INF else rate, **summarize(records, duration)}
                found.append({**run, "transport": client.name, "deployment": deployment, **tags})
                logger.info(
                    "%s rate %s: %.1f output tok/s, TTFT p50 %s ms, %d failures",
                    client.name,
                    run["rate"],
                    run["output_tokens_per_s"],
                    run["ttft_ms"]["p50"],
                    run["failures"],
                )
        return found

    return [run for transport in transports for run in asyncio.run(runs(transport))]


def run_serving(requests: list[BenchRequest], options: ServingOptions) -> dict:
    """All rates over each transport against one process, then the split comparison."""
    finite = tuple(r for r in options.rates if r != INF)
    plans = [(False, options.transports, (*finite, INF))]  # saturation always runs, once
    if options.split_services:
        plans.append((True, options.split_transports, (max(finite), INF) if finite else (INF,)))
    runs: list[list[dict]] = [[], []]
    for split, transports, rates in plans:
        with ServerProcess(options.model, split, options.engine_flags) as server:
            runs[split] = _load_runs(server, transports, requests, rates, options.seed)
    return {
        "runs": runs[0] + runs[1],
        "split_ratios": split_ratios(*runs),
        **totals(requests),
    }


def split_ratios(one: list[dict], split: list[dict]) -> list[dict]:
    """split / one process, per (transport, rate) measured both ways."""
    by_key = {(r["transport"], r["rate"]): r for r in one}
    ratios = []
    for run in split:
        base = by_key.get((run["transport"], run["rate"]))
        if base is not None and base["output_tokens_per_s"]:
            ratios.append(
                {"transport": run["transport"], "rate": run["rate"]}
                | {name: ratio(figure(run, key), figure(base, key)) for name, key, _ in METRICS}
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
            on: ServerProcess(options.model, split, (*flags, *["--async-scheduling"] * on))
            for on in (False, True)
        }
        with servers[False], servers[True]:
            for round_index in range(options.rounds):
                for on, server in servers.items():
                    tags = {"async_scheduling": on, "round": round_index}
                    runs += _load_runs(
                        server, (options.transport,), requests, rates, options.seed, **tags
                    )
    return {
        "runs": runs,
        "ratios": async_ratios(runs),
        "rounds": options.rounds,
        **totals(requests),
    }


def async_ratios(runs: list[dict]) -> list[dict]:
    """on / off per (deployment, rate): the median over rounds of each round's ratio, and
    the ratio of the bests over the rounds (a shared machine's other jobs only slow a run)."""
    by_key: dict[tuple, dict] = {}
    for run in runs:
        modes = by_key.setdefault((run["deployment"], run["rate"]), {True: {}, False: {}})
        modes[run["async_scheduling"]][run["round"]] = run
    ratios = []
    for (deployment, rate), modes in by_key.items():
        on, off = modes[True], modes[False]
        rounds = sorted(set(on) & set(off))
        if not rounds:
            continue
        entry = {"deployment": deployment, "rate": rate, "rounds": len(rounds)}
        for name, key, best in METRICS:
            mine, theirs = ([figure(m[i], key) for i in rounds] for m in (on, off))
            entry[name] = median(map(ratio, mine, theirs))
            bests = (best((v for v in vs if v is not None), default=None) for vs in (mine, theirs))
            entry[f"{name}_best"] = ratio(*bests)
        ratios.append(entry)
    return ratios
