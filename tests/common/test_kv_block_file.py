"""KV block files (services/common/kv_block_file.py) and the model's KV identity
(services/common/kv_offload_identity.py): round trips, every mismatch read as None, scans
that read headers only, identities equal exactly when the model and settings are."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from services.common import kv_block_file
from services.common.config import CacheConfig, ModelConfig
from services.common.kv_block_file import HEADER_BYTES, block_path, read, remove, scan, write
from services.common.kv_offload_identity import DESCRIPTION_FILE, kv_offload_identity
from services.common.worker_info import ModelInfo
from tests.helpers.tiny_gguf import tiny_gguf_file

IDENTITY = bytes(range(32))
OTHER = bytes(range(1, 33))
KEY = b"\x11" * 32
KEY2 = b"\x22" * 32
PAYLOAD = os.urandom(5000)


def test_round_trip(tmp_path: Path) -> None:
    path = block_path(tmp_path, KEY)
    write(path, IDENTITY, KEY, PAYLOAD, fsync=True)
    assert path.name == KEY.hex() + ".kv"
    assert path.stat().st_size == HEADER_BYTES + len(PAYLOAD)
    assert read(path, IDENTITY, KEY, len(PAYLOAD)) == PAYLOAD
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left


@pytest.mark.parametrize("case", ["identity", "key", "size", "missing"])
def test_read_refuses_what_does_not_match(tmp_path: Path, case: str) -> None:
    path = block_path(tmp_path, KEY)
    write(path, IDENTITY, KEY, PAYLOAD)
    identity, key, nbytes = IDENTITY, KEY, len(PAYLOAD)
    if case == "identity":
        identity = OTHER
    elif case == "key":
        key = KEY2
    elif case == "size":
        nbytes -= 1
    else:
        path = block_path(tmp_path, KEY2)
    assert read(path, identity, key, nbytes) is None


def test_a_renamed_file_is_refused_by_read_and_scan(tmp_path: Path) -> None:
    write(block_path(tmp_path, KEY), IDENTITY, KEY, PAYLOAD)
    os.replace(block_path(tmp_path, KEY), block_path(tmp_path, KEY2))
    assert read(block_path(tmp_path, KEY2), IDENTITY, KEY2, len(PAYLOAD)) is None
    assert scan(tmp_path, IDENTITY) == []


def test_truncated_and_flipped_files_read_as_none(tmp_path: Path) -> None:
    path = block_path(tmp_path, KEY)
    write(path, IDENTITY, KEY, PAYLOAD)
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[HEADER_BYTES + 1234] ^= 0x01
    path.write_bytes(bytes(flipped))
    assert read(path, IDENTITY, KEY, len(PAYLOAD)) is None
    for cut in (10, HEADER_BYTES, len(data) - 1):
        path.write_bytes(data[:cut])
        assert read(path, IDENTITY, KEY, len(PAYLOAD)) is None
    path.write_bytes(data + b"x")  # longer than its header says
    assert read(path, IDENTITY, KEY, len(PAYLOAD)) is None


def test_scan_lists_ours_and_skips_the_rest(tmp_path: Path) -> None:
    write(block_path(tmp_path, KEY), IDENTITY, KEY, PAYLOAD)
    write(block_path(tmp_path, KEY2), OTHER, KEY2, PAYLOAD)  # another model's
    truncated = block_path(tmp_path, b"\x33" * 32)
    write(truncated, IDENTITY, b"\x33" * 32, PAYLOAD)
    truncated.write_bytes(truncated.read_bytes()[:-1])
    (tmp_path / "notes.txt").write_text("not a block")
    (tmp_path / ("zz" * 32 + ".kv")).write_bytes(b"x" * 200)  # not hex
    (tmp_path / ("44" * 32 + ".kv")).mkdir()  # a folder with a block's name
    found = scan(tmp_path, IDENTITY)
    assert [(key, nbytes) for key, nbytes, _ in found] == [(KEY, len(PAYLOAD))]
    assert abs(found[0][2] - block_path(tmp_path, KEY).stat().st_mtime) < 1e-6
    assert scan(tmp_path / "absent", IDENTITY) == []


def test_scan_reads_headers_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge file with a bad header (sparse: 4 GiB that take no disk) is skipped after
    reading HEADER_BYTES of it, and a good file's payload is never read."""
    write(block_path(tmp_path, KEY), IDENTITY, KEY, PAYLOAD)
    huge = block_path(tmp_path, KEY2)
    with open(huge, "wb") as f:
        f.write(b"garbage header")
        f.truncate(4 << 30)
    reads: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, f) -> None:
            self.f = f

        def read(self, n: int = -1) -> bytes:
            reads.append(n)
            return self.f.read(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    monkeypatch.setattr(
        kv_block_file, "open", lambda *a, **k: Counting(real_open(*a, **k)), raising=False
    )
    assert [key for key, _, _ in scan(tmp_path, IDENTITY)] == [KEY]
    assert reads == [HEADER_BYTES, HEADER_BYTES]


def test_remove_and_stale_temporaries(tmp_path: Path) -> None:
    write(block_path(tmp_path, KEY), IDENTITY, KEY, PAYLOAD)
    assert remove(tmp_path, KEY) is True
    assert remove(tmp_path, KEY) is False
    stale = tmp_path / f".{KEY.hex()}.kv.1-2.tmp"
    fresh = tmp_path / f".{KEY2.hex()}.kv.1-3.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert kv_block_file.remove_stale_temporaries(tmp_path, older_than_s=600) == 1
    assert not stale.exists() and fresh.exists()


def test_bad_keys_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="key must be 32 bytes"):
        write(tmp_path / "x.kv", IDENTITY, b"short", PAYLOAD)
    with pytest.raises(ValueError, match="identity must be 32 bytes"):
        scan(tmp_path, b"short")


# -- the identity --------------------------------------------------------------------------


def _model_folder(root: Path, weight: bytes) -> Path:
    folder = root / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(weight)
    return folder


def _info(**overrides: object) -> ModelInfo:
    fields = dict(
        model="m", architecture="LlamaForCausalLM", dtype="float32", device="cpu",
        num_layers=2, num_kv_heads=2, head_dim=8, vocab_size=100, eos_token_ids=(0,),
        max_model_len=64,
    )  # fmt: skip
    return ModelInfo(**(fields | overrides))


def test_identity_is_equal_for_equal_models_and_settings(tmp_path: Path) -> None:
    weight = os.urandom(3 << 20)
    folder = _model_folder(tmp_path, weight)
    model, cache = ModelConfig(model=str(folder)), CacheConfig()
    first = kv_offload_identity(model, cache, _info())
    assert kv_offload_identity(model, cache, _info()) == first
    assert len(first.digest) == 32
    assert first.directory(tmp_path) == tmp_path / first.hex[:32]
    changed = {
        "dtype": kv_offload_identity(model, cache, _info(dtype="bfloat16")),
        "kv dtype": kv_offload_identity(model, CacheConfig(cache_dtype="bfloat16"), _info()),
        "block size": kv_offload_identity(model, CacheConfig(block_size=32), _info()),
        "layout": kv_offload_identity(model, cache, _info(num_kv_heads=1)),
        "tp": kv_offload_identity(model, cache, _info(tensor_parallel_size=2)),
        "quantization": kv_offload_identity(
            ModelConfig(model=str(folder), quantization="int8"), cache, _info()
        ),
    }
    for what, identity in changed.items():
        assert identity.digest != first.digest, what
    assert first.for_rank(0) == first
    assert first.for_rank(1).digest not in (first.digest, first.for_rank(2).digest)


@pytest.mark.parametrize("offset", [5, (1 << 20) - 1, (3 << 20) - 7])
def test_identity_follows_a_weight_byte_in_its_edges(tmp_path: Path, offset: int) -> None:
    weight = bytearray(os.urandom(3 << 20))
    folder = _model_folder(tmp_path, bytes(weight))
    model, cache = ModelConfig(model=str(folder)), CacheConfig()
    before = kv_offload_identity(model, cache, _info())
    weight[offset] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(weight))
    assert kv_offload_identity(model, cache, _info()).digest != before.digest


def test_identity_follows_config_json(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, b"w" * 100)
    model, cache = ModelConfig(model=str(folder)), CacheConfig()
    before = kv_offload_identity(model, cache, _info())
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert kv_offload_identity(model, cache, _info()).digest != before.digest


def test_prepare_writes_the_description(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path, b"w" * 100)
    identity = kv_offload_identity(ModelConfig(model=str(folder)), CacheConfig(), _info())
    directory = identity.prepare(tmp_path / "offload")
    assert directory == identity.directory(tmp_path / "offload")
    described = json.loads((directory / DESCRIPTION_FILE).read_text())
    assert described["digest"] == identity.hex
    assert described["model"] == str(folder) and described["block_size"] == 16
    assert identity.prepare(tmp_path / "offload") == directory  # again: unchanged


def test_a_gguf_models_identity_covers_its_file(tmp_path: Path, monkeypatch) -> None:
    """A GGUF model's weights stay in its file (the converted folder holds config and
    tokenizer): the file is fingerprinted, so a changed tensor byte changes the identity."""
    path = tiny_gguf_file(tmp_path, monkeypatch, "Q8_0")
    model, cache = ModelConfig(model=str(path)), CacheConfig()
    before = kv_offload_identity(model, cache, _info())
    assert path.name in [entry[0] for entry in before.description["files"]["weights"]]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last tensor's last byte: same size, still a valid file
    path.write_bytes(bytes(data))
    assert kv_offload_identity(model, cache, _info()).digest != before.digest
