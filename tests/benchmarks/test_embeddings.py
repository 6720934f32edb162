"""`pagestream bench embed --profile smoke` on a tiny model: every configuration runs on
the same inputs, pagestream's embeddings agree with HF AutoModel's, and the report renders
its table; HF's padded batches pool each row's last real position. The encoder mode on its
tiny shape (no llama-server): a BERT vocabulary's layout, the same embeddings as
sentence-transformers, llama-server's comparison marked absent."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from benchmarks.embeddings import (
    ENCODER_PROFILES,
    HF,
    SPECIALS,
    ST,
    EncoderOptions,
    hf_embed,
    run_encoders,
)
from benchmarks.reports import EMBED, ENCODER
from tests.benchmarks.bench import assert_tables, bench, report
from tests.worker.conftest import isolated_model_cache


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


def test_encoder_mode_tiny(tmp_path, monkeypatch):
    cache = isolated_model_cache(tmp_path / "cache", monkeypatch)
    part = run_encoders(EncoderOptions(("tiny",), ENCODER_PROFILES["smoke"], llamacpp=False))
    folder = cache / "encoder_bench" / "tiny"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 30522 and tokenizer.convert_tokens_to_ids(SPECIALS) == [0, 1, 2, 3, 4]
    assert (folder / "vocab.txt").read_text().splitlines()[:5] == SPECIALS
    ids = tokenizer("The harbour town").input_ids
    assert ids[0] == 2 and ids[-1] == 3 and 1 not in ids  # [CLS] ... [SEP], no [UNK]
    (shape,) = part["shapes"]
    assert shape["llama_server"] == {"error": "not run (--no-llamacpp)"}
    assert shape["inputs"]["count"] == 12 and shape["inputs"]["max"] <= 256
    ours, auto, st = shape["runs"]
    assert (ours["config"], st["config"]) == ("pagestream float32", f"{ST}, batch 4")
    assert ours["dtype"] == "float32" and auto["dtype"] in ("float32", "bfloat16")
    assert auto["cosine_min"] > 0.99 and auto["single_ms"] > 0
    assert ours["cosine_min"] > 0.9999 and ours["vs_st"] > 0 and ours["vs_llama"] is None
    assert ours["single_ms"] > 0 and st["single_ms"] > 0
    lines = ENCODER.render({**part, "meta": {}})
    assert lines[0] == f"## {ENCODER.heading}" and "### shapes: tiny" in lines
    assert any("llama server: error not run (--no-llamacpp)" in line for line in lines)
    assert_tables("\n".join(lines))
