"""Routing across data-parallel replicas: `pagestream serve -dp 2` under each --router-policy.

Conversations whose turns share a long system prompt, shuffled together and sent in a closed
loop over gRPC to a fresh server per policy and round (rotated order) whose KV cache per
replica holds only some of the prefixes; /metrics before and after give each replica's
prefix-cache queries and hits and the router's decisions."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import urllib.request
from dataclasses import asdict, dataclass

import numpy as np

from benchmarks.load_clients import GrpcClient, ServerProcess, figure, send_all, summarize
from benchmarks.results import percentiles, rotated
from benchmarks.workload import BenchRequest, CorpusSource, totals

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "least_loaded")
DATA_PARALLEL_SIZE = 2
BLOCK_SIZE = 16  # the engine's default --block-size


@dataclass(frozen=True)
class RoutingProfile:
    name: str
    conversations: int
    turns: int  # requests per conversation
    system_prompt_len: int
    question_len: int
    output_len: int
    concurrency: int  # requests in flight (closed loop)
    # How many conversations' requests (system prompt, question and output blocks) one
    # replica's KV cache holds; None: all of them, twice over (no eviction at all).
    kv_conversations: float | None
    rounds: int = 1
    seed: int = 0

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns


ROUTING_PROFILES = {
    # Concurrency 1 and a cache that never evicts: cache_aware computes each conversation's
    # prefix once, the least any policy can, so no policy may get more hits.
    "smoke": RoutingProfile("smoke", 3, 3, 48, 8, 4, concurrency=1, kv_conversations=None),
    # ~10 minutes on 2 cores: a replica holds 5 of the 8 conversations.
    "quick": RoutingProfile(
        "quick", 8, 6, 512, 24, 32, concurrency=4, kv_conversations=5, rounds=2
    ),
    "full": RoutingProfile(
        "full", 16, 8, 1024, 32, 64, concurrency=8, kv_conversations=10, rounds=3
    ),
}
COUNTERS = {f"pagestream:prefix_cache_{key}_total": key for key in ("queries", "hits")}
# summarize_policies' figures: (its name, where a run has it)
SUMMARY_FIELDS = {"hit_rate": "hit_rate"}
SUMMARY_FIELDS |= {
    f"{f}_{p}_ms": f"{f}_ms.{p}" for f in ("ttft", "itl", "e2e") for p in ("p50", "p99")
}
SUMMARY_FIELDS |= {key: key for key in ("output_tokens_per_s", "requests_per_s", "duration_s")}


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    request: BenchRequest


def conversation_workload(tokenizer, profile: RoutingProfile) -> list[Turn]:
    """Every conversation's turns (its system prompt, a question of its own: windows of
    benchmarks/data/corpus.txt), shuffled together (seeded)."""
    rng = np.random.default_rng(profile.seed)
    corpus = CorpusSource(tokenizer)
    offsets = corpus.offsets(rng, profile.conversations + profile.num_requests)
    systems = [
        corpus.window(o, profile.system_prompt_len) for o in offsets[: profile.conversations]
    ]
    questions = iter(offsets[profile.conversations :])
    turns = []
    for c, system in enumerate(systems):
        for t in range(profile.turns):
            question = corpus.window(next(questions), profile.question_len)
            turns.append(Turn(c, t, BenchRequest(system + question, profile.output_len)))
    return [turns[i] for i in rng.permutation(len(turns))]


def best_hit_rate(profile: RoutingProfile, block_size: int = BLOCK_SIZE) -> float:
    """Hits / queries when every conversation's prefix is computed exactly once."""
    shape = (profile.conversations, profile.turns, profile.system_prompt_len, profile.question_len)
    return hit_rate_bound(*shape, block_size=block_size)


def hit_rate_bound(
    conversations: int,
    turns: int,
    system_prompt_len: int,
    question_len: int,
    computed: int = 1,
    block_size: int = BLOCK_SIZE,
) -> float:
    """The hit rate when each conversation's prefix (its full blocks of system prompt) is
    computed ``computed`` times (once per replica it went to) and never evicted."""
    cached = system_prompt_len // block_size * block_size
    hits = conversations * max(0, turns - computed) * cached
    return round(hits / (conversations * turns * (system_prompt_len + question_len)), 4)


def kv_cache_plan(folder: str, profile: RoutingProfile, block_size: int = BLOCK_SIZE) -> dict:
    """The KV cache per replica (float32) for the profile's kv_conversations."""
    from benchmarks.ceiling import ModelShapes

    block_bytes = ModelShapes.of(folder).kv_bytes_per_token() * block_size
    tokens = profile.system_prompt_len + profile.question_len + profile.output_len
    per_request = -(-tokens // block_size)
    held = profile.kv_conversations or 2 * profile.conversations
    blocks = math.ceil(held * per_request)
    return {
        "bytes_per_replica": blocks * block_bytes,
        "blocks_per_replica": blocks,
        "block_size": block_size,
        "block_bytes": block_bytes,
        "conversations_held": held,
        "prefix_blocks_per_conversation": profile.system_prompt_len // block_size,
        "blocks_per_request": per_request,
    }


@dataclass
class RoutingOptions:
    model: str
    profile: RoutingProfile
    kv_cache_memory: str | int | None = None  # None: kv_cache_plan's
    threads_per_replica: int = max(1, (os.cpu_count() or 2) // DATA_PARALLEL_SIZE)
    rounds: int | None = None  # None: the profile's


def run_routing(tokenizer, options: RoutingOptions) -> dict:
    """Every policy on a fresh `serve -dp 2`, round after round; runs and their medians."""
    profile = options.profile
    turns = conversation_workload(tokenizer, profile)
    plan = kv_cache_plan(options.model, profile)
    kv = options.kv_cache_memory or plan["bytes_per_replica"]
    concurrency = profile.concurrency
    rounds = options.rounds or profile.rounds
    requests = [t.request for t in turns]
    runs = []
    for round_index in range(rounds):
        for policy in rotated(POLICIES, round_index):
            run = asyncio.run(_run_policy(options, policy, requests, kv, concurrency))
            runs.append({**run, "round": round_index})
    workload = {k: v for k, v in asdict(profile).items() if k not in ("name", "kv_conversations")}
    return {
        "workload": {
            **workload,
            "concurrency": concurrency,
            **totals(requests),
            "order": " ".join(str(t.conversation) for t in turns),  # conversation of each request
            "transport": GrpcClient.name,
        },
        "kv_cache": {
            **plan,
            "kv_cache_memory": str(kv),
            "given": options.kv_cache_memory is not None,
        },
        "threads_per_replica": options.threads_per_replica,
        "data_parallel_size": DATA_PARALLEL_SIZE,
        "best_hit_rate": best_hit_rate(profile),
        "rounds": rounds,
        "runs": runs,
        "summary": summarize_policies(runs),
    }


async def _run_policy(options: RoutingOptions, policy: str, requests, kv, concurrency: int):
    """A fresh `serve -dp 2` under `policy`: two short requests at once (one per replica
    under every policy; shorter than a block, they leave no prefix cached), the metrics,
    the closed loop, the metrics again."""
    flags = ("--data-parallel-size", str(DATA_PARALLEL_SIZE), "--router-policy", policy)
    flags += ("--kv-cache-memory", str(kv), "--dtype", "float32")
    threads = str(options.threads_per_replica)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    start = time.perf_counter()
    with ServerProcess(options.model, engine_flags=flags, env=env) as server:
        startup_s, load = time.perf_counter() - start, os.getloadavg()[0]
        async with GrpcClient(server.grpc_address) as client:
            warm = BenchRequest(requests[0].prompt_token_ids[-(BLOCK_SIZE // 2) :], 4)
            for record in await asyncio.gather(client.send(warm), client.send(warm)):
                if not record.ok:
                    raise RuntimeError(f"warm-up failed: {record.error}")
            before = await asyncio.to_thread(read_metrics, server.url)
            records, duration = await send_all(client, requests, concurrency)
            after = await asyncio.to_thread(read_metrics, server.url)
    e2e = percentiles((r.end - r.sent for r in records if r.ok), scale=1e3)
    run = {**summarize(records, duration), "e2e_ms": e2e, **cache_deltas(before, after)}
    logger.info(
        "%s: hit rate %.3f, requests per engine %s, TTFT p50 %s ms, %.1f output tok/s",
        policy,
        run["hit_rate"],
        [e["requests"] for e in run["engines"].values()],
        run["ttft_ms"]["p50"],
        run["output_tokens_per_s"],
    )
    return {
        "policy": policy,
        **run,
        "startup_s": round(startup_s, 1),
        "load_average": round(load, 2),
    }


def read_metrics(base_url: str) -> dict[str, dict]:
    """Per engine: prefix-cache queries and hits, and router decisions by reason."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    engines: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (engine := sample.labels.get("engine")) is None:
                continue
            entry = engines.setdefault(engine, {"queries": 0, "hits": 0, "reasons": {}})
            if key := COUNTERS.get(sample.name):
                entry[key] = int(sample.value)
            elif sample.name == "pagestream:router_requests_total":
                entry["reasons"][sample.labels["reason"]] = int(sample.value)
    return engines


def cache_deltas(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """What the run added to each engine's counters, and the hit rate over all engines."""
    engines = {}
    for name, end in sorted(after.items()):
        start = before.get(name, {"queries": 0, "hits": 0, "reasons": {}})
        reasons = {r: n - start["reasons"].get(r, 0) for r, n in sorted(end["reasons"].items())}
        reasons = {r: n for r, n in reasons.items() if n}
        queries, hits = end["queries"] - start["queries"], end["hits"] - start["hits"]
        engines[name] = {
            "requests": sum(reasons.values()),
            "queries": queries,
            "hits": hits,
            "hit_rate": round(hits / queries, 4) if queries else None,
            "reasons": reasons,
        }
    queries = sum(e["queries"] for e in engines.values())
    hits = sum(e["hits"] for e in engines.values())
    return {"hit_rate": round(hits / queries, 4) if queries else 0.0, "engines": engines}


def summarize_policies(runs: list[dict]) -> list[dict]:
    """Per policy (in the order first run): the median of each figure over its rounds."""
    by_policy: dict[str, list[dict]] = {}
    for run in runs:
        by_policy.setdefault(run["policy"], []).append(run)
    summary = []
    for policy, policy_runs in by_policy.items():
        entry: dict = {"policy": policy, "rounds": len(policy_runs)}
        for key, path in SUMMARY_FIELDS.items():
            values = [v for r in policy_runs if (v := figure(r, path)) is not None]
            digits = 4 if key == "hit_rate" else 2
            entry[key] = round(float(np.median(values)), digits) if values else None
        entry["requests_per_engine"] = [
            [e["requests"] for _, e in sorted(r["engines"].items())] for r in policy_runs
        ]
        entry["failures"] = sum(r["failures"] for r in policy_runs)
        summary.append(entry)
    return summary
