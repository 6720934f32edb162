"""LoRA adapters against the base model, offline on the CPU: `pagestream bench lora`.

The model's float weights through the in-process `LLM` at dtype auto (bfloat16 on a CPU
with native bf16), greedy, ignore_eos, on the profile's default workload (its synthetic
prompts, benchmarks/workload.py; the first `num_requests` requests), every request in one
generate call (continuous batching).

Adapters (benchmarks/lora_adapters.py): random PEFT LoRA adapters of each rank of `ranks`,
made by the benchmark itself, once, into `adapter_dir` (default
$PAGESTREAM_CACHE/bench-lora, one folder per model, rank and index): peft.get_peft_model
over the model's HF weights (transformers, the same folder), every q/k/v/o/gate/up/down
projection of every layer targeted, lora_alpha = r (scale 1), init_lora_weights=False and
then every A and B drawn from a seeded normal of std `adapter_std` (0.01). Small on
purpose: the outputs stay sensible text, and greedy tokens still move off the base model's
(each run says how many stay equal). Nothing is downloaded; peft is a dev dependency
(`pip install peft` where it is missing).

Configurations: the base model alone (enable_lora off); LoRA on with no request using an
adapter (the largest run's max_loras and max_lora_rank: what having LoRA on costs); then,
for each rank and each count n of `adapter_counts`, n adapters with the requests spread
round-robin (request i runs adapter i mod n), max_loras = max_cpu_loras = n (all of them in
one step) and max_lora_rank = the rank.

One chat: the base model, LoRA on with no adapter, and one adapter of each rank (on the
engine of that rank's fewest adapters) also run the workload's first `chat_requests`
requests one after the other (batch 1), each output capped at `chat_max_tokens`: the time
per output token of a single conversation.

Each round runs every configuration once, in an order rotated each round, on an engine of
its own (no prefix caching; warmed up at one request and at the whole batch with every
adapter it serves, so that loading them is not timed); figures are medians over the
rounds, each ratio the median of each round's ratio to that round's base run. Per run:
output tokens/s (every output token over the wall time of the generate calls), TPOT (per
request, its first to its last token over its tokens - 1; the median request) and how many
requests' greedy tokens equal the base model's (LoRA on with no adapter: all of them must).

The issue's targets: 4 adapters of rank 8 cost at most 15% of the base model's output
tok/s, 16 adapters at most 30%; checked on the continuous-batching runs of every rank
(rank 8 is the target; the others are shown against the same bounds).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from dataclasses import dataclass

from benchmarks.lora_adapters import ADAPTER_STD, adapter_folders, adapter_info
from benchmarks.offline import make_llm, token_ids, warm_up
from benchmarks.results import against_baseline, rotated
from benchmarks.token_clock import TokenClock
from benchmarks.workload import BenchRequest, Profile, Workload, greedy_inputs, make_workload

logger = logging.getLogger(__name__)

BASE = "base model"
NO_ADAPTER = "LoRA on, no adapter"
TARGET_RANK = 8  # the rank the targets name
TARGETS = ((4, 0.15), (16, 0.30))  # (adapters, the most output tok/s they may cost)


@dataclass(frozen=True)
class LoRAProfile:
    name: str
    num_requests: int  # the default workload's first requests, one generate call
    rounds: int
    chat_requests: int  # one chat: requests one after the other
    chat_max_tokens: int  # the cap on their output lengths


# One round at quick (2 cores, bfloat16): 8 engines over 32 requests (6.2k output tokens,
# ~25 s for the base model) and 4 chats of 2 x 128 tokens, ~5 minutes; the first run also
# makes the adapters (16 of each rank, 1.4 GB in float32: ~30 s).
LORA_PROFILES = {
    "smoke": LoRAProfile("smoke", 16, 1, 2, 8),  # the drivers end to end
    "quick": LoRAProfile("quick", 32, 2, 2, 128),  # ~10 min on 2 cores
    "full": LoRAProfile("full", 128, 3, 4, 256),  # ~45 min on 2 cores
}


@dataclass(frozen=True)
class LoRAOptions:
    model: str  # the model's folder (float weights)
    profile: LoRAProfile
    workload_profile: Profile  # the default workload's shapes
    kv_cache_memory: str = "2GiB"
    ranks: tuple[int, ...] = (8, 64)
    adapter_counts: tuple[int, ...] = (1, 4, 16)
    adapter_std: float = ADAPTER_STD
    adapter_dir: str | None = None  # default: $PAGESTREAM_CACHE/bench-lora
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}.")
        if not self.adapter_counts or min(self.adapter_counts) < 1:
            raise ValueError(f"adapter counts must be >= 1, got {self.adapter_counts}.")
        profile = self.profile
        if profile.rounds < 1 or profile.num_requests < 1 or profile.chat_requests < 1:
            raise ValueError("rounds, num_requests and chat_requests must be >= 1.")
        if profile.chat_max_tokens < 2 or self.adapter_std <= 0:
            raise ValueError("chat_max_tokens must be >= 2 and adapter_std > 0.")


# ---- the adapters' requests --------------------------------------------------------
def lora_requests(folders: list[str], rank: int) -> list:
    """One LoRARequest per adapter folder (ids 1, 2, ...)."""
    from pagestream import LoRARequest

    return [LoRARequest(f"bench-r{rank}-{i}", i + 1, path) for i, path in enumerate(folders)]


def spread(loras: list, num_requests: int) -> list:
    """Request i's adapter: loras[i mod len(loras)] (None for every request without any)."""
    return [loras[i % len(loras)] if loras else None for i in range(num_requests)]


# ---- the configurations ----------------------------------------------------------------
@dataclass(frozen=True)
class LoRASetup:
    label: str
    adapters: int = 0  # how many adapters the requests are spread over
    rank: int | None = None
    limits: tuple[int, int] | None = None  # (max_loras, max_lora_rank); None: LoRA off
    chat: bool = False  # also one chat at a time (with one adapter where it has any)

    def engine_kwargs(self) -> dict:
        if self.limits is None:
            return {}
        max_loras, max_rank = self.limits
        return {
            "enable_lora": True,
            "max_loras": max_loras,
            "max_lora_rank": max_rank,
            "max_cpu_loras": max_loras,
        }

    def describe(self) -> dict:
        max_loras, max_rank = self.limits or (None, None)
        return {
            "enable_lora": self.limits is not None,
            "adapters": self.adapters,
            "rank": self.rank,
            "max_loras": max_loras,
            "max_lora_rank": max_rank,
        }

    @property
    def chat_label(self) -> str:
        return f"1 adapter, rank {self.rank}" if self.adapters else self.label


def configurations(options: LoRAOptions) -> list[LoRASetup]:
    """The base model, LoRA on with no adapter (the largest run's limits), then each rank
    with each adapter count; the chats on the first two and each rank's fewest adapters."""
    fewest = min(options.adapter_counts)
    largest = (max(options.adapter_counts), max(options.ranks))
    setups = [LoRASetup(BASE, chat=True), LoRASetup(NO_ADAPTER, limits=largest, chat=True)]
    for rank in options.ranks:
        for n in options.adapter_counts:
            label = f"{n} adapter{'s' * (n > 1)}, rank {rank}"
            setups.append(LoRASetup(label, n, rank, (n, rank), chat=n == fewest))
    return setups


# ---- the measurement -------------------------------------------------------------------
def timed_generate_lora(llm, prompts: list[dict], params, loras) -> tuple[float, list]:
    """(seconds, outputs) of one `LLM.generate` with each prompt's adapter."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, outputs


def measure(llm, requests: list[BenchRequest], loras: list, batch: int | None = None) -> dict:
    """One run: `requests` with their adapters, `batch` per generate call (None: all)."""
    prompts, params = greedy_inputs(requests)
    step = batch or len(prompts)
    clock = TokenClock()
    elapsed, tokens = 0.0, []
    with clock.attached(llm.engine):
        for start in range(0, len(prompts), step):
            chunk = slice(start, start + step)
            seconds, outputs = timed_generate_lora(llm, prompts[chunk], params[chunk], loras[chunk])
            elapsed += seconds
            tokens += token_ids(outputs)
    tpots = clock.tpot_ms()
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(map(len, tokens)),
        "tpot_ms": statistics.median(tpots) if tpots else None,
        "token_ids": tokens,
    }


def warm_up_lora(llm, requests: list[BenchRequest], loras: list) -> None:
    """The engine's first calls, at one request and at the whole batch with its adapters
    (short prompts, a few tokens: every adapter loaded into its slot), before any timing."""
    warm_up(llm, requests[0])
    short = [BenchRequest(r.prompt_token_ids[:32], 8) for r in requests]
    llm.generate(*greedy_inputs(short), use_tqdm=False, lora_request=loras)
    llm.engine.scheduler.kv.reset_prefix_cache()


def run_config(
    setup: LoRASetup,
    requests: list[BenchRequest],
    chat: list[BenchRequest],
    adapters: dict[int, list[str]],
    options: LoRAOptions,
    found: dict,
) -> dict:
    """One configuration on an engine of its own: the batch run, appended to
    found[("batch", label)], and its chat, to found[("chat", chat label)]. Returns the
    engine's info."""
    llm = make_llm(
        options.model,
        options.dtype,
        options.kv_cache_memory,
        enable_prefix_caching=False,
        **setup.engine_kwargs(),
    )
    loras = lora_requests(adapters[setup.rank][: setup.adapters], setup.rank) if setup.rank else []
    per_request = spread(loras, len(requests))
    warm_up_lora(llm, requests, per_request)
    run = measure(llm, requests, per_request)
    found.setdefault(("batch", setup.label), []).append(run)
    logger.info("%s: %.1f output tok/s", setup.label, run["output_tokens"] / run["elapsed_s"])
    if setup.chat:
        one = spread(loras[:1], len(chat))
        run = measure(llm, chat, one, batch=1)
        found.setdefault(("chat", setup.chat_label), []).append(run)
        logger.info("%s, one chat: TPOT %.2f ms", setup.chat_label, run["tpot_ms"] or 0.0)
    info = llm.engine.model_info
    engine = {"dtype": info.dtype, "weight_bytes": info.weight_bytes}
    del llm
    gc.collect()
    return engine


def summarize(label: str, setup: LoRASetup, runs: list[dict], baseline: list[dict]) -> dict:
    """One configuration's runs: medians over its rounds, its ratios to the same rounds'
    base runs, and its greedy outputs' agreement with the base model's (the round that
    agrees least)."""
    return {"config": label, **setup.describe(), **against_baseline(runs, baseline, "base")}


def check_targets(runs: list[dict]) -> list[dict]:
    """Each target (adapters, the most they may cost) against each rank's run of that many
    adapters: its ratio to the base model, its cost (1 - ratio), met or not."""
    checked = []
    for run in runs:
        for count, most in TARGETS:
            if run["adapters"] != count or run["vs_base"] is None:
                continue
            checked.append(
                {
                    "adapters": count,
                    "rank": run["rank"],
                    "issue_target": run["rank"] == TARGET_RANK,
                    "max_cost": most,
                    "vs_base": run["vs_base"],
                    "cost": round(1 - run["vs_base"], 3),
                    "met": run["vs_base"] >= 1 - most,
                }
            )
    return checked


def run_lora(tokenizer, options: LoRAOptions) -> dict:
    import torch

    profile = options.profile
    adapters = adapter_folders(options)
    pool = max(profile.num_requests, profile.chat_requests)
    workload = make_workload(
        tokenizer, dataclasses.replace(options.workload_profile, num_requests=pool)
    ).requests
    requests = workload[: profile.num_requests]
    chat = [
        BenchRequest(r.prompt_token_ids, min(r.output_len, profile.chat_max_tokens))
        for r in workload[: profile.chat_requests]
    ]
    setups = configurations(options)
    found: dict[tuple[str, str], list[dict]] = {}
    engines: dict[str, dict] = {}
    for round_index in range(profile.rounds):
        for setup in rotated(setups, round_index):
            engines[setup.label] = run_config(setup, requests, chat, adapters, options, found)
    runs = [
        summarize(s.label, s, found[("batch", s.label)], found[("batch", BASE)]) for s in setups
    ]
    chats = [
        summarize(s.chat_label, s, found[("chat", s.chat_label)], found[("chat", BASE)])
        for s in setups
        if s.chat
    ]
    off = next(r for r in runs if r["config"] == NO_ADAPTER)
    if off["equal_outputs"] != off["requests"]:
        logger.warning(
            "LoRA on with no adapter: %d of %d requests' greedy tokens differ from the base "
            "model's",
            off["requests"] - off["equal_outputs"],
            off["requests"],
        )
    return {
        "profile": profile.name,
        "rounds": profile.rounds,
        "num_requests": len(requests),
        "chat_requests": len(chat),
        "chat_max_tokens": profile.chat_max_tokens,
        "ranks": list(options.ranks),
        "adapter_counts": list(options.adapter_counts),
        "threads": torch.get_num_threads(),
        "dtype": engines[BASE]["dtype"],
        "weight_bytes": engines[BASE]["weight_bytes"],
        "adapters": adapter_info(adapters, options),
        "workload": Workload(requests, options.workload_profile).summary(),
        "runs": runs,
        "chat": chats,
        "targets": check_targets(runs),
    }
