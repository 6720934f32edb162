"""`pagestream bench precision --profile smoke` on a tiny model: both dtypes run side by
side over the same requests, agreement counts are consistent, and the report gets its
section once, however often the benchmark runs."""

from __future__ import annotations

from benchmarks.reports import PRECISION
from benchmarks.results import agreement, first_difference
from tests.benchmarks.bench import bench


def test_first_difference_and_agreement():
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 9, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    summary = agreement([[1, 2, 3], [4, 0, 6]], reference=[[1, 2, 3], [4, 5, 6]])
    assert summary == {
        "requests": 2,
        "equal": 1,
        "mean_first_difference": 2.0,
        "mean_output_len": 3.0,
    }


def test_bench_precision_smoke(model_dir, tmp_path):
    argv = ["precision", "--profile", "smoke", "--model", str(model_dir("llama"))]
    argv += ["--num-requests", "6", "--kv-cache-memory", "16MiB"]
    part = bench(tmp_path, *argv, times=2)["precision"]  # a second run replaces the section
    offline = part["offline"]
    assert offline["requests"] == 6 and offline["rounds"] == 2
    fp32, bf16 = offline["runs"]
    assert (fp32["variant"], bf16["variant"]) == ("float32", "bfloat16")
    assert fp32["vs_baseline"] == 1.0 and fp32["equal_outputs"] == 6  # its own tokens
    for run in offline["runs"]:
        assert len(run["output_tok_s_per_round"]) == 2 and run["output_tok_s"] > 0
        assert run["tpot_ms"] > 0 and run["requests"] == 6
    assert 0 <= bf16["equal_outputs"] <= 6
    assert 0 <= bf16["mean_first_difference"] <= bf16["output_tokens"] / 6
    assert "pagestream bench precision --profile smoke" in offline["meta"]["command"]
    report = (tmp_path / "benchmarks.md").read_text()
    assert (
        report.count(f"## {PRECISION.heading}\n") == 1
        and "| variant | float32 | bfloat16 |" in report
    )
