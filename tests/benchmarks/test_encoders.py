"""The encoder mode (benchmarks/encoders.py) on its tiny shape (no llama-server): a BERT
vocabulary's layout, the same embeddings as sentence-transformers, llama-server's
comparison marked absent, and the report renders its tables."""

from __future__ import annotations

from transformers import AutoTokenizer

from benchmarks.encoders import ENCODER_PROFILES, SPECIALS, ST, EncoderOptions, run_encoders
from benchmarks.reports import ENCODER
from tests.benchmarks.bench import assert_tables
from tests.helpers.model_cache import isolated_model_cache


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
