"""`pagestream bench embed --profile smoke` on a tiny model: every configuration runs on
the same inputs, pagestream's embeddings agree with HF AutoModel's, and the report renders
its table; HF's padded batches pool each row's last real position."""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from transformers import AutoModel

from benchmarks.cli import add_bench_parser, run_bench
from benchmarks.embeddings import HF, hf_embed
from benchmarks.report_embeddings import HEADING


def test_hf_padded_batches_equal_one_at_a_time(model_dir):
    model = AutoModel.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()
    inputs = [[5, 17, 33, 99, 250], [3, 4], [8, 9, 10, 11, 12, 13, 14, 15]]
    batched = hf_embed(model, inputs)
    alone = np.concatenate([hf_embed(model, [ids]) for ids in inputs])
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, rtol=1e-5)


def test_bench_embed_smoke(model_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    argv = ["bench", "embed", "--profile", "smoke", "--model", str(model_dir("llama"))]
    argv += ["--docs-dir", str(tmp_path), "--kv-cache-memory", "16MiB"]
    assert run_bench(parser.parse_args(argv)) == 0
    results = json.loads((tmp_path / "benchmarks" / "results.json").read_text())
    part = results["embed"]["offline"]
    assert "pagestream bench embed --profile smoke" in part["meta"]["command"]
    labels = [r["config"] for r in part["runs"]]
    assert labels == [
        "pagestream float32",
        "pagestream dtype auto",
        f"{HF}, batch 1",
        f"{HF}, batch 4",
    ]
    for run in part["runs"]:
        assert run["inputs_per_s"] > 0 and run["vs_hf"] > 0 and run["tokens_per_s"] > 0, run
    by_label = {r["config"]: r for r in part["runs"]}
    assert by_label["pagestream float32"]["cosine_min"] > 0.9999  # the same float32 model
    assert by_label[f"{HF}, batch 4"]["cosine_min"] > 0.9999  # padding changes nothing
    assert by_label["pagestream float32"]["single_ms"] > 0
    assert part["inputs"]["count"] == 8
    text = (tmp_path / "benchmarks.md").read_text()
    assert text.count(HEADING) == 1
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            assert line.endswith("|") and "None" not in line, line
