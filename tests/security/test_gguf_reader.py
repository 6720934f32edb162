"""Hostile GGUF files against the reader (services/common/gguf_file.py): each file is built
byte by byte to lie about one field, and must be refused with a GGUFError naming the file
and that field, in milliseconds and megabytes whatever the header claims; random and
mutated files never raise anything else; and the path a user passes a model through
(resolve_model, LLM) reports the same error."""

from __future__ import annotations

import re
import struct
import time
import tracemalloc

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common import gguf_file
from services.common.gguf_file import GGUFError, GGUFFile
from services.common.model_errors import ModelLoadError

# value types (gguf's GGUFValueType) and tensor types (ggml's) the files below use
U8, U32, STRING, ARRAY, U64 = 0, 4, 8, 9, 10
F32, Q8_0 = 0, 8
# What refusing one hostile file may cost at most: it is a hundred bytes long, whatever
# its header claims.
MAX_SECONDS, MAX_PEAK_BYTES = 0.5, 4 << 20


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, kind: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", kind) + payload


def array(element: int, count: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IQ", element, count) + payload


def tensor(name: str | bytes, ne: list[int], kind: int = F32, offset: int = 0, n_dims=None):
    dims = len(ne) if n_dims is None else n_dims
    return string(name) + struct.pack(f"<I{len(ne)}QIQ", dims, *ne, kind, offset)


ARCH = kv("general.architecture", STRING, string("llama"))
# two F32 tensors: 8 elements (32 bytes) at data offset 0, 4 x 8 (128 bytes) at 32
TENSORS = [tensor("a", [8]), tensor("b", [8, 4], offset=32)]
DATA = bytes(160)


def gguf_bytes(
    kvs=(ARCH,),
    tensors=tuple(TENSORS),
    data: bytes = DATA,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
) -> bytes:
    """A GGUF v3 file: header, metadata, tensor table, padding to `alignment`, data."""
    header = b"GGUF" + struct.pack(
        "<IQQ",
        3,
        len(tensors) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    body = header + b"".join(kvs) + b"".join(tensors)
    return body + bytes(-len(body) % alignment) + data


def refused(tmp_path, content: bytes) -> str:
    """The GGUFError message for a file of `content`, checked to name the file and to cost
    at most MAX_SECONDS and MAX_PEAK_BYTES."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(content)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(GGUFError) as info:
            GGUFFile(path)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert elapsed < MAX_SECONDS, f"{elapsed:.3f} s to refuse: {message}"
    assert peak < MAX_PEAK_BYTES, f"{peak} bytes to refuse: {message}"
    return message


def test_the_baseline_file_loads(tmp_path):
    """The file the attacks below alter, unaltered: so each refusal is for its one lie."""
    path = tmp_path / "fine.gguf"
    path.write_bytes(gguf_bytes())
    gguf = GGUFFile(path)
    assert gguf.architecture == "llama"
    assert [(t.name, t.shape, t.nbytes) for t in gguf.tensors] == [
        ("a", (8,), 32),
        ("b", (4, 8), 128),
    ]
    assert gguf.raw(gguf.tensors[1]).shape == (4, 32)


HUGE = 1 << 63
ATTACKS = {
    # counts: checked against their bound and the bytes left, before any loop or allocation
    "kv count over the bound": (
        gguf_bytes(n_kv=HUGE),
        f"declares {HUGE} metadata entries; at most {gguf_file.MAX_METADATA_KEYS} load",
    ),
    "kv count over the file": (
        gguf_bytes(n_kv=100),
        "declares 100 metadata entries, but the .* bytes left hold at most",
    ),
    "tensor count over the bound": (
        gguf_bytes(n_tensors=HUGE),
        f"declares {HUGE} tensors; at most {gguf_file.MAX_TENSORS} load",
    ),
    "tensor count over the file": (
        gguf_bytes(n_tensors=1000),
        "declares 1000 tensors, but the .* bytes left hold at most",
    ),
    # dimensions: the 100-byte file with n_dims = 2^28 used to cost gigabytes
    "n_dims 2^28": (
        gguf_bytes(tensors=[tensor("blk.0.attn_q.weight", [8], n_dims=1 << 28)]),
        "tensor 'blk.0.attn_q.weight' has 268435456 dimensions; GGUF allows 1 to at most 4",
    ),
    "n_dims 5": (
        gguf_bytes(tensors=[tensor("blk.0.attn_q.weight", [1, 1, 1, 1, 1])]),
        "tensor 'blk.0.attn_q.weight' has 5 dimensions",
    ),
    "n_dims 0": (gguf_bytes(tensors=[tensor("a", [])]), "tensor 'a' has 0 dimensions"),
    "a zero dimension": (
        gguf_bytes(tensors=[tensor("a", [8, 0])]),
        r"tensor 'a' has a zero dimension in \[8, 0\]",
    ),
    "elements over int64": (
        gguf_bytes(tensors=[tensor("a", [1 << 32, 1 << 32])]),
        r"tensor 'a' with dimensions \[4294967296, 4294967296\] has more than 2\^63 - 1",
    ),
    "bytes over the file": (  # np.prod used to wrap such products silently
        gguf_bytes(tensors=[tensor("a", [1 << 31, 1 << 31])]),
        "tensor 'a' needs 18446744073709551616 bytes; the whole file has",
    ),
    "partial quantized block": (
        gguf_bytes(tensors=[tensor("a", [33], kind=Q8_0)]),
        r"tensor 'a' \(Q8_0\) has rows of 33 elements, not whole blocks of 32",
    ),
    "unknown tensor type": (
        gguf_bytes(tensors=[tensor("a", [8], kind=99)]),
        "tensor 'a' has unknown tensor type 99",
    ),
    # alignment: a non-zero power of two, stored as uint32
    "alignment 0": (
        gguf_bytes(kvs=[ARCH, kv("general.alignment", U32, struct.pack("<I", 0))]),
        "metadata 'general.alignment' is 0; it must be a non-zero power of two",
    ),
    "alignment 48": (
        gguf_bytes(kvs=[ARCH, kv("general.alignment", U32, struct.pack("<I", 48))]),
        "metadata 'general.alignment' is 48",
    ),
    "alignment as uint64": (
        gguf_bytes(kvs=[ARCH, kv("general.alignment", U64, struct.pack("<Q", 32))]),
        "metadata 'general.alignment' has value type 10; GGUF stores it as uint32",
    ),
    # offsets: each tensor exactly where the one before it ends, padded to the alignment
    "misaligned offset": (
        gguf_bytes(tensors=[TENSORS[0], tensor("b", [8, 4], offset=36)]),
        "tensor 'b' starts at data offset 36, not a multiple of the alignment 32",
    ),
    "overlapping offset": (
        gguf_bytes(tensors=[tensor("a", [16]), tensor("b", [8, 4], offset=32)]),
        r"tensor 'b' starts at data offset 32, inside the tensor before it \(which ends at 64\)",
    ),
    "out of order": (
        gguf_bytes(tensors=[tensor("a", [8], offset=128), tensor("b", [8, 4])]),
        "tensor 'a' starts at data offset 128; the tensor before it ends at 0",
    ),
    "data past the end": (
        gguf_bytes(data=DATA[:100]),
        r"is truncated: tensor 'b' needs bytes \[\d+, \d+\) but the file has",
    ),
    # names and keys
    "duplicate tensor name": (
        gguf_bytes(tensors=[TENSORS[0], tensor("a", [8, 4], offset=32)]),
        "tensor 'a' appears twice",
    ),
    "duplicate metadata key": (
        gguf_bytes(kvs=[ARCH, ARCH]),
        "metadata key 'general.architecture' appears twice",
    ),
    "tensor name over 63 bytes": (
        gguf_bytes(tensors=[tensor("x" * 64, [8])]),
        "the name of tensor #0 is 64 bytes long; GGUF allows at most 63",
    ),
    "key length 2^63": (
        gguf_bytes(kvs=[struct.pack("<Q", HUGE)]),
        f"metadata key #0 is {HUGE} bytes long; GGUF allows at most 65535",
    ),
    "string value past the end": (
        gguf_bytes(kvs=[kv("general.name", STRING, struct.pack("<Q", HUGE))]),
        f"metadata 'general.name' needs {HUGE} bytes at offset",
    ),
    # value types and arrays
    "unknown value type": (
        gguf_bytes(kvs=[kv("general.name", 13, b"")]),
        "metadata 'general.name' has unknown value type 13",
    ),
    "array of an unknown type": (
        gguf_bytes(kvs=[kv("x.list", ARRAY, array(13, 1))]),
        "metadata 'x.list' is an array of unknown value type 13",
    ),
    "arrays nested 3 deep": (
        gguf_bytes(kvs=[kv("x.list", ARRAY, array(ARRAY, 1, array(ARRAY, 1, array(U8, 0))))]),
        "metadata 'x.list' nests arrays 3 deep; at most 2 load",
    ),
    "array count 2^63 of uint32": (
        gguf_bytes(kvs=[kv("x.list", ARRAY, array(U32, HUGE))]),
        f"metadata 'x.list' needs {HUGE * 4} bytes",
    ),
    "array count over the file": (
        gguf_bytes(kvs=[kv("x.list", ARRAY, array(STRING, 1000))]),
        "declares 1000 values in metadata 'x.list', but the .* bytes left hold at most",
    ),
    "array items over the bound": (
        gguf_bytes(kvs=[kv("x.list", ARRAY, array(ARRAY, gguf_file.MAX_ARRAY_ITEMS + 1))]),
        "metadata 'x.list' brings the strings and arrays inside the file's metadata arrays",
    ),
    "strings past the end": (
        gguf_bytes(kvs=[kv("x.list", ARRAY, array(STRING, 2, string("ok") + string(b"")[:-1]))]),
        "the 2 strings of metadata 'x.list' run past",
    ),
    "string length 2^63 in an array": (
        gguf_bytes(kvs=[kv("x.list", ARRAY, array(STRING, 1, struct.pack("<Q", HUGE)))]),
        "strings of metadata 'x.list' run past",
    ),
    # the header itself
    "cut inside the header": (b"GGUF" + struct.pack("<I", 3) + bytes(4), "the header needs"),
    "version 1": (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1; versions 2 and 3"),
}


@pytest.mark.parametrize(("content", "message"), ATTACKS.values(), ids=ATTACKS.keys())
def test_a_hostile_file_is_refused_quickly_naming_the_field(tmp_path, content, message):
    assert re.search(message, refused(tmp_path, content))


def test_a_hostile_file_is_a_model_load_error_on_the_users_path(tmp_path, monkeypatch):
    """resolve_model, which every role and LLM pass the user's model through, refuses the
    file with the reader's message before gguf's GGUFReader or transformers read it, and
    leaves nothing in the cache."""
    from services.common.cache_dir import CACHE_ENV
    from services.common.model_source import resolve_model

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_bytes(tensors=[tensor("blk.0.attn_q.weight", [8], n_dims=1 << 28)]))
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="has 268435456 dimensions") as info:
        resolve_model(bad)
    assert isinstance(info.value, GGUFError) and str(bad) in str(info.value)
    assert time.perf_counter() - start < 5
    assert not any((tmp_path / "cache" / "models").iterdir())


def test_llm_refuses_a_hostile_file_with_the_readers_error(tmp_path, monkeypatch):
    """LLM("bad.gguf"): the same GGUFError, before any worker or engine starts."""
    from pagestream import LLM

    monkeypatch.setenv("PAGESTREAM_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_bytes(tensors=[TENSORS[0], tensor("b", [8, 4], offset=36)]))
    with pytest.raises(GGUFError, match="tensor 'b' starts at data offset 36, not a multiple"):
        LLM(str(bad))


# -- property: random and mutated files ----------------------------------------------------


def _valid_file(path) -> bytes:
    """A small GGUF written by gguf's own writer: scalars, a string, a string array, an array
    of arrays, and an F32 and a Q8_0 tensor."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "def"])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_tensor("a.weight", np.arange(24, dtype=np.float32).reshape(3, 8))
    q8 = np.zeros((2, 34), dtype=np.uint8)  # two rows of one Q8_0 block (32 elements)
    writer.add_tensor("b.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-property")
    return folder, _valid_file(folder / "valid.gguf")


def test_the_property_tests_valid_file_loads(workdir):
    folder, _ = workdir
    gguf = GGUFFile(folder / "valid.gguf")
    assert [t.name for t in gguf.tensors] == ["a.weight", "b.weight"]
    assert gguf.metadata["x.nested"].count == 2


def _read_or_refuse(path, content: bytes) -> None:
    """The reader on `content`: a GGUFError, or a file whose every tensor is readable."""
    path.write_bytes(content)
    try:
        gguf = GGUFFile(path)
    except GGUFError as exc:
        assert str(path) in str(exc)
        return
    for t in gguf.tensors:
        assert gguf.raw(t).nbytes == t.nbytes


# (offset, value) overwrites: integers of the widths GGUF stores, at interesting values
_WIDTHS = st.sampled_from(["<B", "<I", "<Q"])
_EDGES = st.sampled_from([0, 1, 2, 3, 4, 5, 31, 32, 33, 63, 64, 255, 2**31, 2**32 - 1, 2**63])


@st.composite
def _overwrite(draw, size: int):
    fmt = draw(_WIDTHS)
    limit = 2 ** (8 * struct.calcsize(fmt)) - 1
    value = draw(st.one_of(_EDGES, st.integers(0, 2**64 - 1))) & limit
    offset = draw(st.integers(0, size - struct.calcsize(fmt)))
    return offset, struct.pack(fmt, value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_files_give_a_gguf_error_or_load(workdir, data):
    folder, valid = workdir
    content = bytearray(valid)
    for offset, packed in data.draw(st.lists(_overwrite(len(valid)), min_size=1, max_size=4)):
        content[offset : offset + len(packed)] = packed
    cut = data.draw(st.integers(0, len(content)))
    _read_or_refuse(folder / "mutated.gguf", bytes(content[:cut] if cut else content))


_NAMES = st.sampled_from(["a", "b", "general.alignment", "x" * 64])
_SCALAR_KV = st.builds(
    lambda key, kind, value: kv(
        key, kind, struct.pack({U8: "<B", U32: "<I", U64: "<Q"}[kind], value)
    ),
    _NAMES,
    st.sampled_from([U8, U32, U64]),
    st.sampled_from([0, 1, 32, 48, 255]),
)
_ARRAY_KV = st.builds(
    lambda key, element, count, payload: kv(key, ARRAY, array(element, count, payload)),
    _NAMES,
    st.sampled_from([U8, U32, STRING, ARRAY, 13]),
    _EDGES,
    st.binary(max_size=40),
)
_TENSOR = st.builds(
    lambda name, ne, kind, offset, n_dims: tensor(name, ne, kind, offset, n_dims),
    _NAMES,
    st.lists(_EDGES, max_size=5),
    st.sampled_from([F32, Q8_0, 12, 99]),
    _EDGES,
    st.one_of(st.none(), st.sampled_from([0, 1, 4, 5, 1 << 28, 2**32 - 1])),  # n_dims
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kvs=st.lists(st.one_of(_SCALAR_KV, _ARRAY_KV), max_size=4),
    tensors=st.lists(_TENSOR, max_size=3),
    data=st.integers(0, 400),
)
def test_files_of_random_fields_give_a_gguf_error_or_load(workdir, kvs, tensors, data):
    """Well-formed layouts whose every count, type, dimension and offset is drawn from the
    values that break readers: 0, 1, the widths' maxima, misaligned and huge offsets."""
    folder, _ = workdir
    _read_or_refuse(folder / "fields.gguf", gguf_bytes([ARCH, *kvs], tensors, bytes(data)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    version=st.sampled_from([2, 3]),
    body=st.binary(max_size=600),
)
def test_random_bytes_after_a_gguf_header_give_a_gguf_error_or_load(workdir, version, body):
    folder, _ = workdir
    _read_or_refuse(folder / "random.gguf", b"GGUF" + struct.pack("<I", version) + body)
