"""benchmarks/gguf_export.py: the F32 / BF16 GGUF files written for llama.cpp hold the very
weights, tokenizer and config pagestream runs from the source GGUF (a tiny Q8_0 model here)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.quants import dequantize
from safetensors.torch import load_file

from benchmarks.gguf_export import SOURCE_KEY, export_gguf, source_gguf
from services.common.model_source import resolve_model
from services.worker.models.gguf_weights import dequantized_folder
from tests.helpers.tiny_gguf import write_tiny_gguf
from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGESTREAM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, build_tiny_model("llama_tied", seed=3, vocab_size=300))
    return path


def _metadata(reader: GGUFReader) -> dict:
    skipped = ("general.file_type", SOURCE_KEY, "GGUF.kv_count")
    return {k: f.contents() for k, f in reader.fields.items() if k not in skipped}


def test_f32_export_is_what_pagestream_loads(source, tmp_path):
    exported = export_gguf(source, "F32", tmp_path / "out")
    assert exported.name == "tiny.Q8_0.F32.gguf"
    src, out = GGUFReader(source), GGUFReader(exported)
    assert _metadata(out) == _metadata(src)
    assert out.fields["general.file_type"].contents() == LlamaFileType.ALL_F32
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    assert any(t.tensor_type == GGMLQuantizationType.Q8_0 for t in src.tensors)
    for a, b in zip(src.tensors, out.tensors, strict=True):
        assert b.tensor_type == GGMLQuantizationType.F32
        np.testing.assert_array_equal(b.data, dequantize(a.data, a.tensor_type), err_msg=a.name)
    # pagestream converts both files into the same HF folder contents
    ours, theirs = resolve_model(source), resolve_model(exported)
    assert ours != theirs
    for name in ("config.json", "tokenizer.json"):
        assert json.loads((ours / name).read_text()) == json.loads((theirs / name).read_text())
    ours, theirs = dequantized_folder(source), dequantized_folder(exported)
    want, got = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=name)


def test_bf16_export_rounds_matrices_like_torch_and_keeps_norms_f32(source, tmp_path):
    exported = export_gguf(source, "BF16", tmp_path)
    out = GGUFReader(exported)
    assert out.fields["general.file_type"].contents() == LlamaFileType.MOSTLY_BF16
    for a, b in zip(GGUFReader(source).tensors, out.tensors, strict=True):
        full = torch.from_numpy(dequantize(a.data, a.tensor_type).copy())
        if full.dim() == 1:
            assert b.tensor_type == GGMLQuantizationType.F32, a.name
            continue
        assert b.tensor_type == GGMLQuantizationType.BF16, a.name
        got = torch.from_numpy(dequantize(b.data, b.tensor_type).copy())
        torch.testing.assert_close(got, full.bfloat16().float(), atol=0, rtol=0, msg=a.name)
        assert not torch.equal(got, full)  # really rounded


def test_export_is_cached_and_redone_when_the_source_changes(source, tmp_path):
    first = export_gguf(source, "F32")
    assert first.parent == tmp_path / "cache" / "gguf"
    stamp = first.stat().st_mtime_ns
    assert export_gguf(source, "F32").stat().st_mtime_ns == stamp
    assert not list(first.parent.glob(".*tmp-*"))
    write_tiny_gguf(source, build_tiny_model("llama_tied", seed=4, vocab_size=320))
    export_gguf(source, "F32")
    assert len(GGUFReader(first).fields["tokenizer.ggml.tokens"].data) == 320


def test_source_gguf_accepts_only_gguf_models(source, tmp_path):
    assert source_gguf(source) == source
    assert source_gguf(source.parent) == source  # a folder holding one .gguf
    folder = tmp_path / "hf"
    build_tiny_model("llama").save_pretrained(folder)
    with pytest.raises(ValueError, match="not a GGUF model"):
        source_gguf(folder)
    with pytest.raises(ValueError, match="dtype"):
        export_gguf(source, "Q4_0")
