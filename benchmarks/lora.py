"""LoRA adapters against the base model, offline on the CPU: `pagestream bench lora`.

The base model, LoRA on with no adapter and n random adapters of each rank (made once with
peft) side by side on the A/B driver, over the default workload in one call and one chat."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from benchmarks.ab_driver import ABDriver, ABWorkload, Variant
from benchmarks.workload import BenchRequest, Profile, make_workload
from services.common.lora_config import TARGET_MODULES

logger = logging.getLogger(__name__)

BASE = "base model"
NO_ADAPTER = "LoRA on, no adapter"
TARGET_RANK = 8  # the rank the targets name
TARGETS = ((4, 0.15), (16, 0.30))  # (adapters, the most output tok/s they may cost)
ADAPTER_STD = 0.01  # every A and B ~ normal(0, std): outputs stay sensible text
ADAPTER_SEED = 0
STAMP = "pagestream_bench_lora.json"  # in each adapter's folder: what it was made from


@dataclass(frozen=True)
class LoRAProfile:
    name: str
    num_requests: int  # the default workload's first requests, one generate call
    rounds: int
    chat_requests: int  # one chat: requests one after the other
    chat_max_tokens: int  # the cap on their output lengths


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
        p = self.profile
        least = min(*self.ranks, *self.adapter_counts, p.rounds, p.num_requests, p.chat_requests)
        if not self.ranks or not self.adapter_counts or least < 1:
            raise ValueError("ranks, adapter counts, rounds and request counts must be >= 1.")
        if p.chat_max_tokens < 2 or self.adapter_std <= 0:
            raise ValueError("chat_max_tokens must be >= 2 and adapter_std > 0.")


def adapter_root(options: LoRAOptions) -> Path:
    from services.common.cache_dir import cache_dir

    return Path(options.adapter_dir) if options.adapter_dir else cache_dir() / "bench-lora"


def made_with(options: LoRAOptions) -> dict:
    return {"std": options.adapter_std, "seed": ADAPTER_SEED, "targets": list(TARGET_MODULES)}


def adapter_folders(options: LoRAOptions) -> dict[int, list[str]]:
    """rank -> the folders of max(adapter_counts) adapters of that rank, each made once (again
    when its stamp changed: the model's weights, the rank, its index or the std)."""
    model = Path(options.model).resolve()
    digest = hashlib.sha256(str(model).encode()).hexdigest()[:8]
    weights = [
        [f.name, f.stat().st_size, f.stat().st_mtime_ns]
        for f in sorted(model.glob("*.safetensors"))
    ]
    folders, missing = {}, {}
    for rank in options.ranks:
        names = [f"{model.name}-{digest}-r{rank}-{i}" for i in range(max(options.adapter_counts))]
        folders[rank] = [adapter_root(options) / name for name in names]
        for index, folder in enumerate(folders[rank]):
            stamp = {"model": str(model), "weights": weights, "rank": rank, "index": index}
            stamp |= made_with(options)
            try:
                made = json.loads((folder / STAMP).read_text()) == stamp
            except (OSError, ValueError):
                made = False
            if not made:
                missing.setdefault(rank, []).append((index, folder, stamp))
    if missing:
        logger.info("making %d random LoRA adapters", sum(map(len, missing.values())))
        make_adapters(model, missing, options.adapter_std)
    return {rank: [str(f) for f in found] for rank, found in folders.items()}


def make_adapters(model: Path, wanted: dict[int, list[tuple[int, Path, dict]]], std: float):
    """Random PEFT adapters: rank -> [(index, folder, stamp)], each A and B ~ normal(0, std)
    seeded by rank and index; the stamp written last, once the folder is whole."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise SystemExit(
            "pagestream bench lora makes its adapters with peft: `pip install peft`."
        ) from exc

    for rank, items in wanted.items():
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(
            r=rank,
            lora_alpha=rank,
            target_modules=list(TARGET_MODULES),
            lora_dropout=0.0,
            bias="none",
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(base, config)
        params = [p for name, p in peft_model.named_parameters() if ".lora_" in name]
        for index, folder, stamp in items:
            generator = torch.Generator().manual_seed(ADAPTER_SEED + 1000 * rank + index)
            with torch.no_grad():
                for param in params:
                    param.normal_(0.0, std, generator=generator)
            (folder / STAMP).unlink(missing_ok=True)
            peft_model.save_pretrained(folder)
            (folder / STAMP).write_text(json.dumps(stamp))
        del peft_model, base
        gc.collect()


def setup(label: str, limits=None, adapters: tuple = (), rank=None, chat=False) -> Variant:
    """A configuration: LoRA off (no limits) or on with (max_loras, max_lora_rank), its
    requests spread round-robin over `adapters`; the chat too where `chat`."""
    max_loras, max_rank = limits or (None, None)
    lora = {"max_loras": max_loras, "max_lora_rank": max_rank}
    engine = {"enable_lora": True, **lora, "max_cpu_loras": max_loras} if limits else {}
    facts = {"enable_lora": limits is not None, "adapters": len(adapters), "rank": rank, **lora}
    return Variant(label, engine, facts, adapters, workloads=None if chat else ("batch",))


def configurations(options: LoRAOptions, adapters: dict[int, list[str]]) -> list[Variant]:
    """The base model, LoRA on with no adapter (the largest run's limits), then each rank
    with each adapter count; the chats on the first two and each rank's fewest adapters."""
    from pagestream import LoRARequest

    largest = (max(options.adapter_counts), max(options.ranks))
    setups = [setup(BASE, chat=True), setup(NO_ADAPTER, largest, chat=True)]
    for rank in options.ranks:
        for n in options.adapter_counts:
            paths = adapters[rank][:n]
            loras = tuple(LoRARequest(f"bench-r{rank}-{i}", i + 1, p) for i, p in enumerate(paths))
            label = f"{n} adapter{'s' * (n > 1)}, rank {rank}"
            setups.append(setup(label, (n, rank), loras, rank, n == min(options.adapter_counts)))
    return setups


def check_targets(runs: list[dict]) -> list[dict]:
    """Each target (adapters, the most they may cost) against each rank's run of that many
    adapters: its ratio to the base model, its cost (1 - ratio), met or not."""
    return [
        {
            "adapters": count,
            "rank": run["rank"],
            "issue_target": run["rank"] == TARGET_RANK,
            "max_cost": most,
            "vs_baseline": run["vs_baseline"],
            "cost": round(1 - run["vs_baseline"], 3),
            "met": run["vs_baseline"] >= 1 - most,
        }
        for run in runs
        for count, most in TARGETS
        if run["adapters"] == count and run["vs_baseline"] is not None
    ]


def run_lora(tokenizer, options: LoRAOptions) -> dict:
    import torch

    from services.common.lora_adapter import WEIGHTS_FILE

    profile = options.profile
    adapters = adapter_folders(options)
    pool = max(profile.num_requests, profile.chat_requests)
    shapes = dataclasses.replace(options.workload_profile, num_requests=pool)
    workload = make_workload(tokenizer, shapes).requests
    requests = workload[: profile.num_requests]
    chat = [
        BenchRequest(r.prompt_token_ids, min(r.output_len, profile.chat_max_tokens))
        for r in workload[: profile.chat_requests]
    ]
    workloads = [
        ABWorkload("batch", requests),  # every request in one generate call
        ABWorkload("chat", chat, batches=(1,), max_adapters=1),  # one after the other
    ]
    driver = ABDriver(
        options.model, workloads, profile.rounds, options.dtype, options.kv_cache_memory
    )
    runs = driver.run(configurations(options, adapters))
    for off in (r for r in runs if r["variant"] == NO_ADAPTER and r["differing_outputs"]):
        what = (off["workload"], off["differing_outputs"], off["requests"])
        logger.warning("LoRA on, no adapter, %s: %d of %d differ from the base model", *what)
    return {
        "profile": profile.name,
        "rounds": profile.rounds,
        "num_requests": len(requests),
        "chat_requests": len(chat),
        "chat_max_tokens": profile.chat_max_tokens,
        "ranks": list(options.ranks),
        "adapter_counts": list(options.adapter_counts),
        "threads": torch.get_num_threads(),
        "dtype": driver.engines[BASE]["dtype"],
        "weight_bytes": driver.engines[BASE]["weight_bytes"],
        "adapters": {
            **made_with(options),
            "folder": str(adapter_root(options)),
            "per_rank": [
                {
                    "rank": rank,
                    "count": len(found),
                    "file_bytes": (Path(found[0]) / WEIGHTS_FILE).stat().st_size,
                }
                for rank, found in adapters.items()
            ],
        },
        "workloads": {w.name: w.summary() for w in workloads},
        "runs": runs,
        "targets": check_targets([r for r in runs if r["workload"] == "batch"]),
    }
