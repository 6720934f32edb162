"""The runners of `pagestream bench routing | structured | precision` (self-contained
sections: each describes its own workload). benchmarks/cli.py dispatches to them."""

from __future__ import annotations

import dataclasses

KV_DEFAULT = "2GiB"  # --kv-cache-memory's default: the sections that size their own cache


def run_routing(args, folder, profile, workload, results) -> dict:
    """serve -dp 2 under each router policy on conversations sharing system prompts; the
    KV cache per replica is sized by the routing profile unless --kv-cache-memory is given."""
    from transformers import AutoTokenizer

    from benchmarks.routing import POLICIES, ROUTING_PROFILES, RoutingOptions, run_routing

    policies = tuple(p.strip() for p in (args.policies or "").split(",") if p.strip())
    options = RoutingOptions(
        model=folder,
        profile=ROUTING_PROFILES[profile.name],
        policies=policies or POLICIES,
        kv_cache_memory=None if args.kv_cache_memory == KV_DEFAULT else args.kv_cache_memory,
        concurrency=args.concurrency,
        rounds=args.rounds,
    )
    return {"dp2": run_routing(AutoTokenizer.from_pretrained(folder), options)}


def run_structured(args, folder, profile, workload, results) -> dict:
    """The same JSON-record prompts unconstrained and with a JSON schema, grammar compile
    times and mask fill per row (benchmarks/structured.py); --num-requests sets the number
    of prompts."""
    from transformers import AutoTokenizer

    from benchmarks.structured import STRUCTURED_PROFILES, StructuredOptions, run_structured

    changes = {"num_prompts": args.num_requests, "rounds": args.rounds}
    structured = dataclasses.replace(
        STRUCTURED_PROFILES[profile.name], **{k: v for k, v in changes.items() if v}
    )
    options = StructuredOptions(
        model=folder, profile=structured, kv_cache_memory=args.kv_cache_memory
    )
    return {"offline": run_structured(AutoTokenizer.from_pretrained(folder), options)}


def run_precision(args, folder, profile, workload, results) -> dict:
    """bfloat16 against float32 on the profile's workload (benchmarks/precision.py):
    throughput side by side and greedy agreement."""
    from benchmarks.precision import PrecisionOptions, run_precision

    requests = workload.requests[: args.num_requests or len(workload.requests)]
    options = PrecisionOptions(folder, args.kv_cache_memory, args.rounds or 2)
    return {"offline": run_precision(requests, options)}


def run_latency(args, folder, profile, workload, results) -> dict:
    """Time per output token at batch 1 / 4 / 16 by dtype, the weight-streaming limit and
    llama.cpp at batch 1 (benchmarks/latency.py)."""
    from benchmarks.latency import LatencyOptions, run_latency

    options = LatencyOptions(
        args.model,
        folder,
        args.kv_cache_memory,
        rounds=args.rounds or 3,
        llamacpp=not args.no_llamacpp,
    )
    return {"batch": run_latency(options)}
