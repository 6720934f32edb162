"""GGUFFile (services/common/gguf_file.py): the memory-mapped reader the worker loads GGUF
weights through, against gguf's own GGUFReader on the same file, and its errors."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from services.common.gguf_file import GGUFError, GGUFFile, MetadataArray
from services.common.model_errors import ModelLoadError
from services.worker.models.gguf_weights import iterate_gguf_weights
from tests.helpers.tiny_gguf import write_tiny_gguf
from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    hf_model = build_tiny_model("qwen2", seed=5, vocab_size=300)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, hf_model, arch="qwen2")
    return path, hf_model.config


def test_tensors_and_metadata_equal_ggufs_reader(tiny_file):
    path, _ = tiny_file
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    assert ours.architecture == "qwen2"
    assert ours.metadata["qwen2.block_count"] == 2
    assert ours.metadata["general.name"] == "tiny-llama"
    tokens = ours.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, MetadataArray) and tokens.count == 300
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.type_name == reference.tensor_type.name
        assert mine.shape == tuple(int(d) for d in reversed(reference.shape))
        raw = ours.raw(mine)
        assert np.array_equal(
            raw.reshape(-1), np.asarray(reference.data).reshape(-1).view(np.uint8)
        )


def test_raw_bytes_are_a_read_only_view_of_the_map(tiny_file):
    gguf = GGUFFile(tiny_file[0])
    raw = gguf.raw(gguf.tensors[0])
    assert not raw.flags.owndata and not raw.flags.writeable


def test_a_truncated_file_names_the_file_and_the_tensor(tiny_file, tmp_path):
    path, config = tiny_file
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    last = GGUFFile(path).tensors[-1].name
    with pytest.raises(GGUFError, match=f"{cut} is truncated: tensor '{last}'"):
        GGUFFile(cut)
    with pytest.raises(ModelLoadError, match="truncated"):
        list(iterate_gguf_weights(cut, config, quantized=True))


def test_a_file_cut_inside_its_metadata_is_refused(tiny_file, tmp_path):
    cut = tmp_path / "header.gguf"
    cut.write_bytes(tiny_file[0].read_bytes()[:200])
    with pytest.raises(GGUFError, match="ends inside its header or metadata"):
        GGUFFile(cut)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "cannot map"),
        (b"GGML" + b"\0" * 60, "not a GGUF file"),
        (b"GGUF\x07\0\0\0", "version 7"),
    ],
)
def test_other_files_are_refused_by_name(tmp_path, content, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content + b"\0" * (24 if content.startswith(b"GGUF") else 0))
    with pytest.raises(GGUFError, match=message) as info:
        GGUFFile(bad)
    assert str(bad) in str(info.value)
