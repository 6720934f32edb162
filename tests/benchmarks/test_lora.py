"""`pagestream bench lora --profile smoke` on a tiny model: every configuration runs beside
the base model, LoRA on with no adapter keeps the base model's greedy tokens, the random
adapters are made once and pass the engine's checks, and the report renders its tables
and targets; the configurations and the targets on their own."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.lora import (
    BASE,
    LORA_PROFILES,
    NO_ADAPTER,
    STAMP,
    LoRAOptions,
    adapter_folders,
    check_targets,
    configurations,
)
from benchmarks.reports import LORA
from benchmarks.workload import PROFILES
from tests.benchmarks.bench import bench, report

LABELS = [
    BASE,
    NO_ADAPTER,
    "1 adapter, rank 8",
    "4 adapters, rank 8",
    "16 adapters, rank 8",
    "1 adapter, rank 64",
    "4 adapters, rank 64",
    "16 adapters, rank 64",
]
CHATS = [BASE, NO_ADAPTER, "1 adapter, rank 8", "1 adapter, rank 64"]


def _options(model: str = "/models/base", **changes) -> LoRAOptions:
    return LoRAOptions(
        model=model, profile=LORA_PROFILES["smoke"], workload_profile=PROFILES["smoke"], **changes
    )


def test_configurations():
    adapters = {r: [f"/a/r{r}-{i}" for i in range(16)] for r in (8, 64)}
    setups = configurations(_options(), adapters)
    assert [s.label for s in setups] == LABELS
    assert setups[0].engine == {} and setups[0].workloads is None  # the chat too
    assert setups[1].engine == {
        "enable_lora": True,
        "max_loras": 16,
        "max_lora_rank": 64,
        "max_cpu_loras": 16,
    }
    assert setups[1].adapters == () and setups[1].facts["enable_lora"]
    assert setups[3].engine["max_loras"] == 4 and setups[3].facts["max_lora_rank"] == 8
    assert [a.lora_path for a in setups[3].adapters] == adapters[8][:4]
    assert [s.label for s in setups if s.workloads is None] == CHATS
    assert [a.lora_path for a in setups[4].spread(3, most=1)] == [adapters[8][0]] * 3
    assert [a.lora_int_id for a in setups[4].spread(18)][15:] == [16, 1, 2]
    assert setups[0].spread(2) == [None, None]
    fewer = configurations(_options(ranks=(16,), adapter_counts=(2, 3)), {16: adapters[8]})
    assert [s.label for s in fewer if s.workloads is None] == [
        BASE,
        NO_ADAPTER,
        "2 adapters, rank 16",
    ]


def test_targets():
    runs = [
        {"adapters": 0, "rank": None, "vs_baseline": 0.99},
        {"adapters": 4, "rank": 8, "vs_baseline": 0.85},
        {"adapters": 16, "rank": 8, "vs_baseline": 0.69},
        {"adapters": 4, "rank": 64, "vs_baseline": 0.7},
        {"adapters": 1, "rank": 64, "vs_baseline": 0.9},
    ]
    checked = check_targets(runs)
    assert [(t["adapters"], t["rank"], t["met"], t["issue_target"]) for t in checked] == [
        (4, 8, True, True),  # exactly 15%: met
        (16, 8, False, True),
        (4, 64, False, False),
    ]
    assert checked[1]["cost"] == 0.31 and checked[1]["max_cost"] == 0.3


def test_bench_lora_smoke(model_dir, tmp_path):
    model = str(model_dir("llama"))
    adapters = tmp_path / "adapters"
    argv = ["lora", "--profile", "smoke", "--model", model, "--kv-cache-memory", "16MiB"]
    results = bench(tmp_path, *argv, "--lora-dir", str(adapters))
    assert "meta" not in results  # the other sections' meta is left alone
    part = results["lora"]["offline"]
    assert "pagestream bench lora --profile smoke" in part["meta"]["command"]
    assert "workload" not in part["meta"] and part["workloads"]["batch"]["num_requests"] == 16
    batch = [r for r in part["runs"] if r["workload"] == "batch"]
    chat = [r for r in part["runs"] if r["workload"] == "chat"]
    assert [r["variant"] for r in batch] == LABELS and [r["variant"] for r in chat] == CHATS
    for run in part["runs"]:
        assert run["output_tok_s"] > 0 and run["vs_baseline"] > 0 and run["tpot_ms"] > 0, run
        assert run["enable_lora"] == (run["variant"] != BASE)
    by_label = {r["variant"]: r for r in batch}
    assert by_label[BASE]["vs_baseline"] == 1.0 and by_label[BASE]["requests"] == 16
    for runs in (batch, chat):  # LoRA on, no adapter: the base model's tokens
        off = next(r for r in runs if r["variant"] == NO_ADAPTER)
        assert off["equal_outputs"] == off["requests"] > 0, off
    assert chat[0]["requests"] == 2 and chat[0]["batch"] == 1
    assert by_label["16 adapters, rank 64"]["max_loras"] == 16
    checked = {(t["adapters"], t["rank"]) for t in part["targets"]}
    assert checked == {(4, 8), (16, 8), (4, 64), (16, 64)}
    assert all(isinstance(t["met"], bool) for t in part["targets"])
    assert [r["rank"] for r in part["adapters"]["per_rank"]] == [8, 64]
    made = sorted(adapters.iterdir())
    assert len(made) == 32 and all((f / STAMP).is_file() for f in made)
    text = report(tmp_path)
    assert text.count(f"## {LORA.heading}\n") == 1 and "### runs: workload chat" in text
    assert "### targets" in text and "| adapters | rank | issue target | max cost |" in text
    # Made once: a second look at the same model finds every folder as it was.
    options = _options(model=model, adapter_dir=str(adapters))
    times = {f: os.stat(f / STAMP).st_mtime_ns for f in made}
    again = adapter_folders(options)
    assert sorted(Path(p) for paths in again.values() for p in paths) == made
    assert times == {f: os.stat(f / STAMP).st_mtime_ns for f in made}


def test_adapters_pass_the_engines_checks(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from services.common.lora_adapter import inspect_adapter
    from services.common.lora_config import TARGET_MODULES, LoRAConfig, LoRATargets

    model = model_dir("llama")
    options = _options(model=str(model), ranks=(4,), adapter_counts=(2,), adapter_dir=str(tmp_path))
    folders = adapter_folders(options)[4]
    hf = AutoModelForCausalLM.from_pretrained(model)
    layers = hf.model.layers
    modules = {
        name: [linear.in_features, linear.out_features]
        for name, linear in layers[0].named_modules()
        if name.rsplit(".", 1)[-1] in TARGET_MODULES
    }
    modules = {name.rsplit(".", 1)[-1]: shape for name, shape in modules.items()}
    targets = LoRATargets(modules, len(layers))
    specs = [inspect_adapter(folder, LoRAConfig(max_lora_rank=4), targets) for folder in folders]
    assert all(s.rank == 4 and s.scale == 1.0 for s in specs)
    assert specs[0].modules == set(TARGET_MODULES)
    assert len(specs[0].targets) == len(TARGET_MODULES) * len(layers)
    assert specs[0].digest != specs[1].digest  # each its own seed
