"""The one report renderer (benchmarks/section_report.py) on recorded results: every section of
docs/benchmarks/results.json renders with every figure its records hold (and those computed from
them), and the committed docs/benchmarks.md is exactly what it renders."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.report import derived, render
from benchmarks.results import load_results, part_of
from benchmarks.section_report import HIDDEN, SectionReport, words
from benchmarks.sections import SECTIONS
from tests.benchmarks.bench import assert_tables

DOCS = Path(__file__).resolve().parents[2] / "docs"
RESULTS = load_results(DOCS / "benchmarks" / "results.json")


def leaves(value, key=""):
    """Every figure of a record: its numbers and strings, but not what the report hides."""
    if key in HIDDEN:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from leaves(v, key)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield value


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.name)
def test_every_recorded_figure_is_in_its_section(section):
    part = part_of(derived(RESULTS), section.key, section.part)
    if not part:
        pytest.skip(f"no recorded {section.name} results")
    text = "\n".join(section.report.render(part))
    assert text.startswith(f"## {section.report.heading}\n")
    cells = set(text.replace("|", " ").replace(",", " ").replace(";", " ").split())
    shown = {k: v for k, v in part.items() if k not in ("load_average", *section.report.code)}
    missing = list(leaves(shown))
    missing = [v for v in missing if str(v) not in cells]
    assert not missing, missing[:10]
    assert_tables(text)


def test_the_committed_report_is_its_results_rendered():
    """docs/benchmarks.md is what the one report writer renders from results.json: every
    section (the ones no smoke run reaches too: llama.cpp, latency, serve --peer,
    quantized, speculative, lora), in order, from the results alone."""
    assert render(RESULTS) + "\n" == (DOCS / "benchmarks.md").read_text(encoding="utf-8")


def test_figures_computed_from_the_recorded_ones():
    old = {
        "memory": {
            "kv_utilization": {
                "num_samples": 3,
                "paged": 0.9,
                "prealloc_max": 0.25,
                "prealloc_oracle": 0.5,
            }
        },
    }
    new = derived(old)
    assert new["memory"]["kv_utilization"]["waste"] == {
        "paged": 0.1,
        "prealloc_max": 0.75,
        "prealloc_oracle": 0.5,
    }
    assert "waste" not in old["memory"]["kv_utilization"]  # the recorded results stay


def test_a_part_renders_facts_tables_groups_and_turned_tables():
    report = SectionReport(
        "A feature", "pagestream bench x", "Words.", code=("schema",), group_by={"runs": "batch"}
    )
    runs = [{"variant": v, "batch": b, "output_tok_s": 10.0 * b} for b in (1, 4) for v in "ab"]
    wide = {f"k{i}": i for i in range(20)}
    part = {
        "rounds": 2,
        "draft": {"file": "d.gguf", "size": None},
        "schema": {"type": "object"},
        "runs": runs,
        "engines": {"x": wide, "y": wide},
        "servers": {"s": {"1": {"tok_s": 3}, "4": {"tok_s": 5}}, "t": {"1": {"tok_s": 4}}},
        "empty": [],
        "summary": {"variants": {"a": {"x": 1}, "b": {"x": 2}}, "ratios": {"a": {"y": 3}}},
    }
    lines = report.render(part)
    text = "\n".join(lines)
    assert lines[:3] == ["## A feature", "", "Words."]
    assert "- figures: rounds 2; empty —" in text and "- draft: file d.gguf; size —" in text
    assert '```json\n{"type": "object"}\n```' in text
    assert "### runs: batch 4" in text and "| b | 40.0 |" in text  # batch: in the title
    assert "| engines | x | y |" in text and "| k19 | 19 | 19 |" in text  # on its side
    assert "| servers |  | tok/s |" in text and "| s | 4 | 5 |" in text
    assert "summary · variants:" in text and "| b | 2 |" in text  # groups of other shapes
    assert "- summary · ratios · a: y 3" in text
    assert words("output_tok_s_per_round") == "output tok/s per round"
    assert words("tpot_vs_baseline") == "tpot x vs baseline"
