"""`pagestream bench routing --profile smoke` on a tiny model: `serve -dp 2` under each
router policy runs the conversations end to end, the metrics add up, and the report has its
section and plot. Smoke sends one request at a time to caches that never evict, so
cache_aware computes each conversation's system prompt once, the least any policy can:
round_robin can match its hit rate but never beat it."""

from __future__ import annotations

import pytest

from benchmarks.reports import ROUTING
from benchmarks.routing import (
    POLICIES,
    ROUTING_PROFILES,
    best_hit_rate,
    conversation_workload,
    kv_cache_plan,
)
from tests.benchmarks.bench import bench, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def routing_run(model_dir, tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs-routing")
    return docs, bench(docs, "routing", "--profile", "smoke", "--model", str(model_dir("llama")))


def test_conversations_share_their_system_prompt_only(model_dir):
    from transformers import AutoTokenizer

    profile = ROUTING_PROFILES["quick"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    turns = conversation_workload(tokenizer, profile)
    assert turns == conversation_workload(tokenizer, profile)  # seeded
    assert len(turns) == profile.conversations * profile.turns
    assert [t.conversation for t in turns] != sorted(t.conversation for t in turns)  # shuffled
    systems = {}
    for t in turns:
        assert t.request.prompt_len == profile.system_prompt_len + profile.question_len
        systems.setdefault(t.conversation, set()).add(
            tuple(t.request.prompt_token_ids[: profile.system_prompt_len])
        )
    assert all(len(s) == 1 for s in systems.values())
    first_blocks = {tuple(t.request.prompt_token_ids[:16]) for t in turns}
    assert len(first_blocks) == profile.conversations  # no prefix shared across conversations
    questions = {tuple(t.request.prompt_token_ids[profile.system_prompt_len :]) for t in turns}
    assert len(questions) == len(turns)


def test_kv_cache_holds_only_some_conversations(model_dir):
    profile = ROUTING_PROFILES["quick"]
    plan = kv_cache_plan(str(model_dir("llama")), profile)
    prefixes = profile.conversations * plan["prefix_blocks_per_conversation"]
    assert plan["blocks_per_replica"] < prefixes  # not every conversation's prefix fits
    half = -(-profile.conversations // 2) * plan["blocks_per_request"]
    assert plan["blocks_per_replica"] >= half + profile.concurrency  # a fair share does
    assert plan["bytes_per_replica"] == plan["blocks_per_replica"] * plan["block_bytes"]
    assert 0 < best_hit_rate(profile) < 1


def test_every_policy_runs_the_conversations(routing_run):
    _, results = routing_run
    assert set(results) == {"routing"}  # other sections and their meta are left alone
    part = results["routing"]["dp2"]
    assert part["meta"]["profile"] == "smoke" and "workload" not in part["meta"]
    assert "pagestream bench routing --profile smoke" in part["meta"]["command"]
    workload = part["workload"]
    assert workload["num_requests"] == 9 and workload["concurrency"] == 1
    assert [r["policy"] for r in part["runs"]] == list(POLICIES)
    for run in part["runs"]:
        assert run["failures"] == 0, run["failure_examples"]
        assert run["completed"] == workload["num_requests"]
        assert set(run["engines"]) == {"0", "1"}
        assert sum(e["requests"] for e in run["engines"].values()) == workload["num_requests"]
        assert sum(e["queries"] for e in run["engines"].values()) == workload["prompt_tokens"]
        assert 0 <= run["hit_rate"] <= part["best_hit_rate"]
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
        assert run["e2e_ms"]["p50"] > 0 and run["output_tokens_per_s"] > 0
    reasons = {r["policy"]: set() for r in part["runs"]}
    for run in part["runs"]:
        for engine in run["engines"].values():
            reasons[run["policy"]] |= set(engine["reasons"])
    assert reasons["round_robin"] == {"round_robin"}
    assert reasons["least_loaded"] == {"least_loaded"}
    assert (
        reasons["cache_aware"] <= {"cache_hit", "cache_miss"}
        and "cache_hit" in reasons["cache_aware"]
    )


def test_cache_aware_hits_at_least_as_often_as_round_robin(routing_run):
    _, results = routing_run
    part = results["routing"]["dp2"]
    rate = {s["policy"]: s["hit_rate"] for s in part["summary"]}
    assert rate["cache_aware"] == part["best_hit_rate"]  # every prefix computed once
    assert rate["cache_aware"] >= rate["round_robin"]


def test_routing_report_section_and_plot(routing_run):
    docs, _ = routing_run
    text = report(docs)
    assert text.count(f"## {ROUTING.heading}\n") == 1 and "### summary" in text
    assert "`pagestream bench routing --profile smoke" in text
    assert "](benchmarks/routing.png)" in text
    assert (docs / "benchmarks" / "routing.png").read_bytes().startswith(PNG_MAGIC)
