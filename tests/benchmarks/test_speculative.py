"""`pagestream bench speculative --profile smoke` on a tiny model: every configuration runs
every workload and batch beside the run without speculation, the counters and agreement
are consistent, and the report renders its tables; the configurations and the draft's
choice on their own."""

from __future__ import annotations

import pytest

from benchmarks.ab_driver import TokenClock
from benchmarks.reports import SPECULATIVE
from benchmarks.speculative import (
    NO_SPECULATION,
    SPECULATIVE_PROFILES,
    SpeculativeOptions,
    configurations,
    draft_label,
    resolve_draft,
    spec_counts,
    summed,
)
from benchmarks.workload import PROFILES
from services.common.engine_output import SchedulerStats
from tests.benchmarks.bench import bench, report


def _options(**changes) -> SpeculativeOptions:
    return SpeculativeOptions(
        model="/models/target",
        source_model="/models/target",
        profile=SPECULATIVE_PROFILES["smoke"],
        workload_profile=PROFILES["smoke"],
        **changes,
    )


def test_configurations_force_speculation_and_add_the_default_at_the_largest_batch():
    configs = configurations(_options(), "/cache/Model.Q4_1.Q4_0.gguf")
    labels = [c.label for c in configs]
    assert labels == [
        NO_SPECULATION,
        "ngram k=2",
        "ngram k=4",
        "ngram k=6",
        "draft target k=3",
        "draft Q4_0 GGUF k=3",
        "ngram k=4, default disable_by_batch_size",
        "draft Q4_0 GGUF k=3, default disable_by_batch_size",
    ]
    assert configs[0].engine["speculative_config"] is None and configs[0].batches is None
    assert configs[1].engine["speculative_config"] == {
        "method": "ngram",
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
        "num_speculative_tokens": 2,
        "disable_by_batch_size": 1000,
    }
    assert configs[4].engine["speculative_config"]["model"] == "/models/target"
    assert configs[-1].batches == (32,)
    assert configs[-1].engine["speculative_config"]["disable_by_batch_size"] == 32
    assert configs[1].facts == {"method": "ngram", "k": 2, "disable_by_batch_size": 1000}
    small = configurations(_options(batches=(1, 4), ks=(3,), self_draft=False), None)
    assert [c.label for c in small] == [NO_SPECULATION, "ngram k=3"]  # no batch reaches 8


def test_the_draft_choice():
    assert resolve_draft(_options(draft="none"))["path"] is None
    assert resolve_draft(_options(draft="/models/draft"))["path"] == "/models/draft"
    not_gguf = resolve_draft(_options(draft="Q4_0"))  # an HF folder has no GGUF file
    assert not_gguf["path"] is None and "not run" in not_gguf["note"]
    assert draft_label("/cache/SmolLM2.Q4_1.gguf") == "Q4_1 GGUF"
    assert draft_label("/models/draft") == "draft"


def test_counters_and_clock():
    before = SchedulerStats(
        spec_decode_num_drafts=2,
        spec_decode_num_draft_tokens=6,
        spec_decode_num_accepted_tokens=3,
        spec_decode_num_accepted_tokens_per_pos=(2, 1),
    )
    after = SchedulerStats(
        spec_decode_num_drafts=5,
        spec_decode_num_draft_tokens=15,
        spec_decode_num_accepted_tokens=7,
        spec_decode_num_accepted_tokens_per_pos=(4, 2, 1),
    )
    counts = spec_counts(before, after)
    assert counts == {
        "num_drafts": 3,
        "num_draft_tokens": 9,
        "num_accepted_tokens": 4,
        "accepted_per_pos": [2, 1, 1],
    }
    assert summed([counts, {**counts, "accepted_per_pos": [1]}])["accepted_per_pos"] == [3, 1, 1]
    clock = TokenClock()
    for rid, n, now in (("a", 1, 1.0), ("b", 2, 1.0), ("a", 3, 1.3), ("b", 0, 2.0)):
        clock._saw(rid, n, now)
    assert clock.tpot_ms() == pytest.approx([100.0, 0.0])  # b: 2 tokens in one step


def test_bench_speculative_smoke(model_dir, tmp_path):
    model = str(model_dir("llama"))
    argv = ["speculative", "--profile", "smoke", "--model", model, "--kv-cache-memory", "16MiB"]
    results = bench(tmp_path, *argv, "--batches", "1,32", "--ks", "2", "--draft", "none")
    assert "meta" not in results  # the other sections' meta is left alone
    part = results["speculative"]["offline"]
    assert "pagestream bench speculative --profile smoke" in part["meta"]["command"]
    assert "workload" not in part["meta"] and set(part["workloads"]) == {"copy", "default"}
    seen = {(r["workload"], r["batch"], r["variant"]) for r in part["runs"]}
    forced = (NO_SPECULATION, "ngram k=2", "draft target k=3")
    defaults = (
        "ngram k=2, default disable_by_batch_size",
        "draft target k=3, default disable_by_batch_size",
    )
    expected = {(w, b, c) for w in ("copy", "default") for b in (1, 32) for c in forced}
    expected |= {(w, 32, c) for w in ("copy", "default") for c in defaults}
    assert seen == expected
    for run in part["runs"]:
        assert run["output_tok_s"] > 0 and run["vs_baseline"] > 0
        assert run["requests"] == (2 if run["batch"] == 1 else 32)
        assert run["differing_outputs"] == 0, run  # greedy: the target's tokens either way
        assert run["num_accepted_tokens"] <= run["num_draft_tokens"]
        if run["variant"] == NO_SPECULATION:
            assert run["num_drafts"] == 0 and run["vs_baseline"] == 1.0
        if run["variant"] == "draft target k=3":  # its own draft: every proposal accepted
            assert run["num_drafts"] > 0 and run["acceptance_rate"] == 1.0
    by_key = {(r["workload"], r["batch"], r["variant"]): r for r in part["runs"]}
    for workload in ("copy", "default"):  # batch 32 at the default 32: proposals stop
        on, default = (by_key[workload, 32, label] for label in (forced[2], defaults[1]))
        assert on["num_drafts"] > default["num_drafts"]
    text = report(tmp_path)
    assert text.count(f"## {SPECULATIVE.heading}\n") == 1 and "### runs: workload copy" in text
