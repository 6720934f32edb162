"""`pagestream bench embed --profile smoke` on a tiny model: every configuration runs on
the same inputs, pagestream's embeddings agree with HF AutoModel's, and the report renders
its table; HF's padded batches pool each row's last real position. The encoder mode is
tests/benchmarks/test_encoders.py's."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModel

from benchmarks.embeddings import HF, hf_embed
from benchmarks.reports import EMBED
from tests.benchmarks.bench import bench, report


def test_hf_padded_batches_equal_one_at_a_time(model_dir):
    model = AutoModel.from_pretrained(model_dir("llama"), dtype=torch.float32).eval()
    inputs = [[5, 17, 33, 99, 250], [3, 4], [8, 9, 10, 11, 12, 13, 14, 15]]
    batched = hf_embed(model, inputs)
    alone = np.concatenate([hf_embed(model, [ids]) for ids in inputs])
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, rtol=1e-5)


def test_bench_embed_smoke(model_dir, tmp_path):
    argv = ["embed", "--profile", "smoke", "--model", str(model_dir("llama"))]
    results = bench(tmp_path, *argv, "--kv-cache-memory", "16MiB")
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
    text = report(tmp_path)
    assert text.count(f"## {EMBED.heading}\n") == 1
