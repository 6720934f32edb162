"""benchmarks/quantized.py and latency.py on tiny models: pagestream runs the file's
blocks and the de-quantized float32 reference, the agreement counts equal requests, and the
ratios pair each file's pagestream run with its llama.cpp run. llama.cpp itself (the bench
extra, not installed in CI) is replaced by a stand-in that returns chosen tokens; the real
one is checked by every `pagestream bench quantized` run (its agreement is in the report)."""

from __future__ import annotations

import pytest

from benchmarks import latency, quantized
from benchmarks.reports import QUANTIZED
from benchmarks.results import RunResult
from benchmarks.workload import BenchRequest
from tests.helpers.tiny_gguf import tiny_gguf_file

REQUESTS = [BenchRequest([5, 17, 200, 31], 6), BenchRequest([3, 99, 150, 22, 7, 8], 5)]


@pytest.fixture
def tiny_q8_0(tmp_path, monkeypatch):
    return tiny_gguf_file(tmp_path, monkeypatch, "Q8_0")


def test_run_quantized_pairs_each_file_with_llamacpp(tiny_q8_0, monkeypatch):
    calls = []

    def fake_llamacpp(requests, path, dtype, n_seq_max, options):
        calls.append((path.name, dtype, n_seq_max))
        tokens = [[1] * r.output_len for r in requests]  # agrees with nothing
        run = RunResult("llama.cpp", 2.0, len(requests), 10, 11, 11, {})
        return run, tokens

    monkeypatch.setattr("benchmarks.llamacpp.run_llamacpp", fake_llamacpp)
    options = quantized.QuantizedOptions(str(tiny_q8_0), kv_cache_memory="16MiB", seqs=4)
    result = quantized.run_quantized(REQUESTS, options)
    assert calls == [("tiny.Q8_0.gguf", "BF16", 4)]
    names = [run["variant"] for run in result["runs"]]
    assert names == [
        "pagestream LLM.generate (float32, de-quantized)",
        "pagestream LLM.generate (bfloat16, de-quantized)",
        "pagestream LLM.generate (Q8_0 blocks)",
        "llama.cpp Q8_0 (4 seqs)",
    ]
    reference, _, ours, theirs = result["runs"]
    assert reference["equal_outputs"] == 2 and reference["vs_baseline"] == 1.0
    assert ours["quantization"] == "Q8_0" and ours["output_tokens"] == 11
    assert ours["dtype"] in ("float32", "bfloat16") and ours["weight_bytes"] > 0
    assert "kv_utilization" not in ours
    ratio = result["ratios"]["pagestream LLM.generate (Q8_0 blocks) / llama.cpp Q8_0 (4 seqs)"]
    assert ratio == pytest.approx(ours["output_tok_s"] / 5.5, rel=0.01)
    assert theirs["output_tok_s"] == 5.5 and theirs["equal_outputs"] == 0  # agrees with nothing
    assert ours["requests"] == 2 and theirs["differing_outputs"] == 2
    lines = "\n".join(QUANTIZED.render(result))
    assert "| variant | pagestream LLM.generate (float32, de-quantized) |" in lines
    assert "| output tok/s |" in lines and "source gguf tiny.Q8_0.gguf" in lines


def test_streaming_bytes_of_the_quantized_runs(tiny_q8_0):
    from gguf import GGUFReader

    matrices = [t for t in GGUFReader(str(tiny_q8_0)).tensors if len(t.shape) == 2]
    assert latency.gguf_matrix_bytes(str(tiny_q8_0)) == sum(int(t.n_bytes) for t in matrices)
    folder = "unused"
    assert latency.decode_bytes(folder, "gguf", str(tiny_q8_0)) == sum(
        int(t.n_bytes) for t in matrices
    )


def test_latency_runs_each_dtype_at_each_batch_on_the_driver(model_dir, monkeypatch):
    monkeypatch.setattr(latency, "read_bandwidth_gb_s", lambda: 10.0)
    monkeypatch.setattr(latency, "_prompt", lambda n: [5 + i % 97 for i in range(n)])  # tiny
    folder = str(model_dir("llama"))
    options = latency.LatencyOptions(
        folder, folder, "16MiB", ("float32", "bfloat16"), (1, 2), 8, 4, 1, llamacpp=False
    )
    part = latency.run_latency(options)
    seen = [(r["variant"], r["batch"], r["requests"]) for r in part["runs"]]
    assert seen == [("float32", 1, 1), ("bfloat16", 1, 1), ("float32", 2, 2), ("bfloat16", 2, 2)]
    assert all(r["tpot_ms"] > 0 and r["output_tokens"] == 4 * r["batch"] for r in part["runs"])
    assert part["read_gb_s"] == [10.0, 10.0] and "llamacpp" not in part["dtypes"]["float32"]
    fp32 = part["dtypes"]["float32"]
    assert fp32["streaming_limit_ms"] == round(fp32["decode_bytes"] / 10e9 * 1e3, 2)
    assert fp32["batch1_over_limit"] > 0
