"""`pagestream bench all --profile smoke` on a tiny model: every driver runs end to end (offline
against HF, serving over HTTP and gRPC against one process and split services, memory) and the
report is well formed. No speed assertions: only that the numbers are there and consistent."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.workload import PROFILES, make_workload, scaled, shared_prefix_workload
from pagestream.bench import add_bench_parser, run_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_run(model_dir, tmp_path_factory):
    """Run the whole smoke benchmark once; returns (docs dir, results)."""
    docs = tmp_path_factory.mktemp("docs")
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    model = str(model_dir("llama"))
    argv = ["bench", "all", "--profile", "smoke", "--model", model, "--docs-dir", str(docs)]
    args = parser.parse_args([*argv, "--kv-cache-memory", "8MiB"])
    assert run_bench(args) == 0
    results = json.loads((docs / "benchmarks" / "results.json").read_text())
    return docs, results


def test_workload_is_seeded_and_shaped(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    profile = PROFILES["quick"]
    first, again = make_workload(tokenizer, profile), make_workload(tokenizer, profile)
    assert [r.prompt_token_ids for r in first.requests] == [
        r.prompt_token_ids for r in again.requests
    ]
    assert len(first.requests) == profile.num_requests == 64
    low, high = profile.prompt_range
    assert all(low <= r.prompt_len <= high for r in first.requests)
    assert all(16 <= r.output_len <= 512 for r in first.requests)
    starts = {tuple(r.prompt_token_ids[:8]) for r in first.requests}
    assert len(starts) == len(first.requests)  # no accidental prefix-cache hits
    assert all(r.output_len >= 8 for r in scaled(first.requests, 0.01))
    shared = shared_prefix_workload(tokenizer, 3, system_len=40, suffix_len=5, output_len=2)
    assert shared[0].prompt_token_ids[:40] == shared[2].prompt_token_ids[:40]
    assert all(r.prompt_len == 45 for r in shared)


def test_throughput_compares_every_engine_on_the_same_work(bench_run):
    _, results = bench_run
    throughput = results["throughput"]
    names = [run["name"] for run in throughput["runs"]]
    assert names[0].startswith("pagestream")
    assert "HF generate, static batch 2" in names and "HF generate, static batch 4" in names
    assert any("continuous" in name for name in names)
    expected = results["meta"]["workload"]["output_tokens"]
    for run in throughput["runs"]:
        assert run["output_tokens"] == expected  # every engine produced exactly the lengths
        assert run["output_tokens_per_s"] > 0
    assert throughput["runs"][0]["num_cached_tokens"] == 0
    ratios = throughput["ratios"]
    assert set(ratios) == {"vs_hf_static_best", "vs_hf_continuous"}
    assert throughput["ceiling"]["gflops"] > 0
    assert all(f > 0 for f in throughput["ceiling"]["fraction"].values())


def test_serving_runs_both_transports_and_the_split(bench_run):
    _, results = bench_run
    serving = results["serving"]
    runs = serving["runs"]
    seen = {(r["deployment"], r["transport"], r["rate"]) for r in runs}
    assert ("one process", "HTTP", 4.0) in seen and ("one process", "gRPC", "inf") in seen
    assert ("split services", "gRPC", "inf") in seen
    for run in runs:
        assert run["failures"] == 0, run["failure_examples"]
        assert run["completed"] == serving["num_requests"]
        assert run["ttft_ms"]["p50"] > 0 and run["tpot_ms"]["p50"] > 0
        assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
    assert {r["rate"] for r in serving["split_ratios"]} == {4.0, "inf"}


def test_memory_reports_utilisation_prefix_hits_and_sharing(bench_run):
    _, results = bench_run
    memory = results["memory"]
    kv = memory["kv_utilization"]
    assert 0 < kv["prealloc_max"] < kv["paged"] <= 1
    prefix = memory["prefix_caching"]
    assert prefix["off"]["cached_tokens"] == 0 < prefix["on"]["cached_tokens"]
    sharing = memory["sharing"]
    independent = sharing["independent"]["peak_blocks"]
    assert 0 < sharing["parallel_sampling"]["peak_blocks"] < independent
    assert 0 < sharing["beam_search"]["peak_blocks"] < independent


def test_report_has_every_section_table_and_plot(bench_run):
    docs, _ = bench_run
    text = (docs / "benchmarks.md").read_text()
    for heading in ("## Headline", "## Offline throughput", "## Online serving", "## Memory"):
        assert heading in text
    assert "pagestream bench all --profile smoke" in text
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            assert line.endswith("|") and "None" not in line, line
    for name in ("throughput", "serving", "kv_utilization", "memory"):
        assert f"](benchmarks/{name}.png)" in text
        assert (docs / "benchmarks" / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
