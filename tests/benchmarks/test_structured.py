"""`pagestream bench structured --profile smoke` on a tiny model: the three runs side by
side, compile times and mask fill are recorded, every constrained output that finished with
stop validates against the schema, the matched-length run has the constrained lengths, and
the report gets its section (once, however often it runs) and its plot."""

from __future__ import annotations

import pytest

from benchmarks.grammar_timing import FILLS, LARK, REGEXES
from benchmarks.reports import STRUCTURED
from benchmarks.results import rotated
from benchmarks.structured import (
    STRUCTURED_PROFILES,
    VARIANTS,
    valid_record,
)
from tests.benchmarks.bench import bench, report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROFILE = STRUCTURED_PROFILES["smoke"]


@pytest.fixture(scope="module")
def structured_run(model_dir, tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs-structured")
    argv = ["structured", "--profile", "smoke", "--model", str(model_dir("llama"))]
    results = bench(docs, *argv, times=2)  # a second run replaces the section
    return docs, results


def round_order(round_index: int) -> list[str]:
    """VARIANTS in the A/B driver's order of a round (it rotates them each round)."""
    return rotated(VARIANTS, round_index)


def test_round_order_runs_matched_length_after_a_constrained_run():
    for rounds in range(1, 5):
        order = [v for r in range(rounds) for v in round_order(r)]
        assert order.index("json_schema") < order.index("matched_length")
        assert sorted(round_order(rounds)) == sorted(VARIANTS)


def test_runs_side_by_side(structured_run):
    _, results = structured_run
    assert set(results) == {"structured"}  # other sections and their meta are left alone
    part = results["structured"]["offline"]
    assert part["meta"]["profile"] == "smoke" and "workload" not in part["meta"]
    assert "pagestream bench structured --profile smoke" in part["meta"]["command"]
    runs = part["runs"]
    assert [r["variant"] for r in runs] == round_order(0)  # smoke: one round
    for run in runs:
        assert run["num_requests"] == PROFILE.num_prompts
        assert sum(run["finish_reasons"].values()) == PROFILE.num_prompts
        assert 0 < run["output_tokens"] <= PROFILE.num_prompts * PROFILE.max_tokens
        assert run["output_tokens_per_s"] > 0 and run["num_steps"] > 0
    by = {r["variant"]: r for r in runs}
    assert by["json_schema"]["mask_rows"] == by["json_schema"]["output_tokens"]
    assert by["unconstrained"]["mask_rows"] == by["matched_length"]["mask_rows"] == 0
    # Held to the constrained lengths: the same tokens, all of them cut by length.
    assert by["matched_length"]["output_tokens"] == by["json_schema"]["output_tokens"]
    assert by["matched_length"]["finish_reasons"] == {"length": PROFILE.num_prompts}
    ratios = part["summary"]["ratios"]
    assert set(ratios) == {"unconstrained", "matched_length"}
    assert all(v > 0 for r in ratios.values() for v in r.values())


def test_every_stopped_constrained_output_validates(structured_run):
    _, results = structured_run
    part = results["structured"]["offline"]
    (constrained,) = [r for r in part["runs"] if r["variant"] == "json_schema"]
    # Compact JSON and seeded sampling: on this random model some outputs close their
    # object within max_tokens (the rest stop mid-string at the length limit).
    assert constrained["valid"]["stopped"] >= 1
    assert constrained["valid"]["stopped"] == constrained["finish_reasons"].get("stop", 0)
    assert constrained["valid"]["stopped_valid"] == constrained["valid"]["stopped"]
    totals = part["summary"]["variants"]["json_schema"]["valid"]
    assert totals["stopped_valid"] == totals["stopped"] == constrained["valid"]["stopped"]
    assert part["example_output"].startswith("{")
    assert valid_record('{"name": "A", "age": 3, "role": "teacher", "skills": [], "active": true}')
    assert not valid_record('{"name": "A"}') and not valid_record("{")


def test_compile_and_mask_fill_recorded(structured_run):
    _, results = structured_run
    part = results["structured"]["offline"]
    compile_times = part["compile"]
    assert compile_times["tokenizer_build_s"] > 0
    kinds = [g["kind"] for g in compile_times["grammars"]]
    assert kinds.count("json") == PROFILE.num_schemas
    assert kinds.count("regex") == len(REGEXES) and kinds.count("lark") == len(LARK)
    for grammar in compile_times["grammars"]:
        assert grammar["cold_ms"] > 0 and len(grammar["cached_ms"]) == PROFILE.cached_repeats
    summary = compile_times["summary"]
    assert summary["cold_ms"]["n"] == len(kinds)
    assert 0 < summary["cold_ms"]["p50"] <= summary["cold_ms"]["p99"]
    mask = part["mask_fill"]
    assert mask["bitmask_mismatches"] == 0 and mask["tokens_rejected"] == 0
    constrained = next(r for r in part["runs"] if r["variant"] == "json_schema")
    assert mask["rows"] == constrained["mask_rows"]  # the same rows, replayed
    assert set(mask["fills"]) == {f"{k}_{s}" for k in FILLS for s in ("cold", "warm")}
    for fill in mask["fills"].values():
        assert fill["us_per_row"]["n"] == mask["positions"] and fill["us_per_row"]["p50"] > 0
    assert set(mask["parallel_speedup"]) == {"cold", "warm"}


def test_structured_report_section_and_plot(structured_run):
    docs, _ = structured_run
    text = report(docs)
    assert text.count(f"## {STRUCTURED.heading}\n") == 1
    assert "`pagestream bench structured --profile smoke" in text
    assert "](benchmarks/structured.png)" in text and "](../" not in text
    assert (docs / "benchmarks" / "structured.png").read_bytes().startswith(PNG_MAGIC)
