"""`pagestream bench all --profile smoke` on a tiny model: every driver runs end to end (offline
against HF, serving over HTTP and gRPC against one process and split services, memory) and the
report is well formed. No speed assertions: only that the numbers are there and consistent."""

from __future__ import annotations

import pytest

from benchmarks.workload import PROFILES, make_workload, scaled, shared_prefix_workload
from tests.benchmarks.bench import bench, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_run(model_dir, tmp_path_factory):
    """Run the whole smoke benchmark once; returns (docs dir, results)."""
    docs = tmp_path_factory.mktemp("docs")
    argv = ["all", "--profile", "smoke", "--model", str(model_dir("llama"))]
    return docs, bench(docs, *argv, "--kv-cache-memory", "8MiB")


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
    text = report(docs)
    for heading in ("## Headline", "## Offline throughput", "## Online serving", "## Memory"):
        assert heading in text
    assert "pagestream bench all --profile smoke" in text
    for name in ("throughput", "serving", "kv_utilization", "memory"):
        assert f"](benchmarks/{name}.png)" in text
        assert (docs / "benchmarks" / f"{name}.png").read_bytes().startswith(PNG_MAGIC)


@pytest.fixture(scope="module")
def parallel_run(model_dir, tmp_path_factory):
    """`pagestream bench parallel --profile smoke` on the tiny Llama (4 query / 2 KV heads,
    2 layers): tp = 1 in process with and without async scheduling, tp = 2, pp = 2, and
    tp = 3, which the model refuses and no head variant of hidden size 64 can take."""
    docs = tmp_path_factory.mktemp("docs-parallel")
    argv = ["parallel", "--profile", "smoke", "--model", str(model_dir("llama"))]
    argv += ["--kv-cache-memory", "8MiB", "--layouts", "tp1,tp1-async,tp2,pp2,tp3"]
    return docs, bench(docs, *argv)


def test_parallel_layouts_run_the_same_work(parallel_run):
    _, results = parallel_run
    parallel = results["parallel"]
    for part in ("offline", "async_serving"):  # each part says how it was measured
        assert parallel[part]["meta"]["profile"] == "smoke"
        assert "pagestream bench parallel --profile smoke" in parallel[part]["meta"]["command"]
        assert parallel[part]["load_average"]["start"] >= 0
    assert "meta" not in results  # the other sections' meta is left alone
    offline = parallel["offline"]
    layouts = [run["layout"] for run in offline["runs"]]
    assert layouts == [
        "tp=1 (in process)",
        "tp=1 (in process), async scheduling",
        "tp=2",
        "pp=2",
    ]
    assert [s["layout"] for s in offline["skipped"]] == ["tp=3"]
    assert "--tensor-parallel-size 3" in offline["skipped"][0]["reason"]
    expected = offline["output_tokens"]
    for run in offline["runs"]:
        assert run["output_tokens"] == expected  # every layout produced exactly the lengths
        assert run["output_tokens_per_s"] > 0 and run["vs_tp1"] > 0
        assert run["identical_outputs"] == offline["num_requests"]  # greedy parity
        assert run["processes"] == (0 if run["tp"] * run["pp"] == 1 else 2)
        steps = run["steps"]
        assert steps["num_steps"] == steps["decode"]["num_steps"] + steps["prefill"]["num_steps"]
        assert steps["prefill"]["num_steps"] >= 1 and steps["decode"]["num_steps"] >= 1
        for kind in ("decode", "prefill"):
            step = steps[kind]
            assert 0 < step["forward_ms"] <= step["worker_ms"] <= step["wall_ms"] + 1e-6
    assert offline["runs"][0]["vs_tp1"] == 1.0
    by_layout = {run["layout"]: run for run in offline["runs"]}
    assert by_layout["tp=2"]["collectives_per_step"] == {"all_reduce": 5, "gather_logits": 1}
    assert by_layout["pp=2"]["collectives_per_step"] == {"recv_hidden": 1}
    decode = by_layout["tp=2"]["steps"]["decode"]
    assert 0 < decode["collectives_min_est_ms"] <= decode["collectives_est_ms"]
    assert decode["collectives_in_step_est_ms"] > 0
    assert "collectives_in_step_est_ms" not in by_layout["pp=2"]["steps"]["decode"]
    assert "collectives_est_ms" not in by_layout["tp=1 (in process)"]["steps"]["decode"]


def test_collective_timings_cover_decode_and_prefill_sizes(parallel_run):
    _, results = parallel_run
    collectives = results["parallel"]["offline"]["collectives"]
    assert set(collectives) == {"2"}  # tp = 2 and pp = 2 are both two processes
    two = collectives["2"]
    assert two["hidden_size"] == 64 and two["threads_per_rank"] >= 1
    for table in ("all_reduce_us", "send_recv_us", "gather_logits_us"):
        assert two[table], table
        for entry in two[table].values():
            assert 0 < entry["min"] <= entry["median"]
    assert {"1", "2048"} <= set(two["all_reduce_us"])
    for entry in two["all_reduce_in_step_us"].values():  # the model's 2 layers, inside a step
        assert entry["without_ms"] > 0 and entry["with_ms"] > 0 and entry["per_call"] >= 0


def test_async_serving_compares_on_and_off_in_both_deployments(parallel_run):
    _, results = parallel_run
    serving = results["parallel"]["async_serving"]
    seen = {(r["deployment"], r["async_scheduling"]) for r in serving["runs"]}
    assert seen == {(d, on) for d in ("one process", "split services") for on in (False, True)}
    for run in serving["runs"]:
        assert run["failures"] == 0, run["failure_examples"]
        assert run["completed"] == serving["num_requests"]
    ratios = {(r["deployment"], r["rate"]): r for r in serving["ratios"]}
    assert set(ratios) == {("one process", "inf"), ("split services", "inf")}
    for ratio in ratios.values():
        assert ratio["rounds"] == 1 and ratio["throughput"] == ratio["throughput_best"] > 0


def test_parallel_report_section(parallel_run):
    docs, _ = parallel_run
    text = report(docs)
    for heading in (
        "## Parallel runs",
        "### offline",
        "offline · runs:",
        "offline · collectives · 2 · all reduce us:",
        "### async serving",
        "async serving · ratios:",
    ):
        assert heading in text, heading
    assert "`pagestream bench parallel --profile smoke" in text
    assert "offline · skipped:" in text and "| tp=3 |" in text


def test_layouts_parse_and_head_variants_divide():
    from benchmarks.head_variant import divisible_heads
    from benchmarks.parallel import Layout

    assert Layout.parse("tp2xpp2") == Layout(2, 2)
    assert Layout.parse("tp1-mp-async") == Layout(1, 1, "mp", True)
    assert Layout.parse("pp2").label == "pp=2"
    with pytest.raises(ValueError, match="layout 'mp'"):
        Layout.parse("mp")
    assert divisible_heads(576, 9, 3, 2) == (8, 2)  # SmolLM2-135M at tp = 2: head_dim 72
    assert divisible_heads(576, 9, 3, 3) == (9, 3)
    assert divisible_heads(64, 4, 2, 3) is None
