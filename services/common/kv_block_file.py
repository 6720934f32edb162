"""One KV block on disk: `<key hex>.kv`, a fixed header then the block's raw bytes.

Header (HEADER_BYTES = 120, little-endian): magic b"PSKVBLK\\0", format version u32,
reserved u32 (0), the model's KV identity (32 bytes, services/common/kv_offload_identity.py),
the block key (32 bytes: its chained block hash, also the file's name), the payload's
length u64 and the payload's sha256 (32 bytes). A reader trusts nothing: every field is
checked, the file's size must be the header plus the payload length, and the payload's
sha256 must match (OpenSSL's sha256 runs ~1 GiB/s a core with SHA-NI: ~0.45 ms for a
1.5B model's 458 KiB block), so a partial write, a file from another model, a renamed
file or a flipped byte reads as None, never as KV. Writes are atomic (a temporary file
in the same folder, then os.replace); scans read headers only.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from pathlib import Path

MAGIC = b"PSKVBLK\x00"
VERSION = 1
KEY_BYTES = 32
IDENTITY_BYTES = 32
SUFFIX = ".kv"
_HEADER = struct.Struct("<8sII32s32sQ32s")
HEADER_BYTES = _HEADER.size  # 120
_TMP_SUFFIX = ".tmp"


def block_path(directory: str | os.PathLike[str], key: bytes) -> Path:
    """Where the block `key` lives in `directory`: `<key hex>.kv`."""
    _check_bytes("key", key, KEY_BYTES)
    return Path(directory) / f"{key.hex()}{SUFFIX}"


def write(
    path: str | os.PathLike[str],
    identity: bytes,
    key: bytes,
    payload: bytes | bytearray | memoryview,
    fsync: bool = False,
) -> None:
    """Write the block atomically: a reader sees the old file, no file, or all of this
    one (never a prefix). `fsync` also survives a power cut (the default survives a
    crash of this process, which is what a restart needs). OSError on a full disk."""
    _check_bytes("identity", identity, IDENTITY_BYTES)
    _check_bytes("key", key, KEY_BYTES)
    data = memoryview(payload).cast("B")
    header = _HEADER.pack(
        MAGIC, VERSION, 0, identity, key, data.nbytes, hashlib.sha256(data).digest()
    )
    path = Path(path)
    # One name per writer thread: concurrent writers of one key never share a temporary.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}{_TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read(
    path: str | os.PathLike[str], identity: bytes, key: bytes, expected_nbytes: int
) -> bytearray | None:
    """The payload of the block `key` written under `identity`, exactly `expected_nbytes`
    long, or None on any mismatch (missing, truncated, another model's, another key's,
    another size, a checksum that does not match)."""
    payload = bytearray(expected_nbytes)
    return payload if read_into(path, identity, key, memoryview(payload)) else None


def read_into(path: str | os.PathLike[str], identity: bytes, key: bytes, out: memoryview) -> bool:
    """`read` into `out` (a writable buffer of exactly the payload's length): True when
    it now holds the verified payload; False on any mismatch (`out` then holds garbage).
    Reads at most the header and len(out) bytes: a file's own length field never sizes
    anything."""
    out = out.cast("B")
    expected_nbytes = out.nbytes
    try:
        with open(path, "rb") as f:
            fields = _parse(f.read(HEADER_BYTES), identity)
            if fields is None or fields[0] != key or fields[1] != expected_nbytes:
                return False
            if os.fstat(f.fileno()).st_size != HEADER_BYTES + expected_nbytes:
                return False
            if f.readinto(out) != expected_nbytes:
                return False
    except OSError:
        return False
    return hashlib.sha256(out).digest() == fields[2]


def scan(directory: str | os.PathLike[str], identity: bytes) -> list[tuple[bytes, int, float]]:
    """(key, payload bytes, mtime) of every block file of `identity` in `directory`, from
    headers only (HEADER_BYTES read per candidate, never a payload). Skipped: names that
    are not `<64 hex>.kv`, other identities or versions, names that disagree with their
    header's key, and files whose size is not header + payload (truncated). A missing
    directory is empty."""
    _check_bytes("identity", identity, IDENTITY_BYTES)
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        key = _key_of_name(entry.name)
        if key is None:
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
            if not entry.is_file(follow_symlinks=False) or stat.st_size < HEADER_BYTES:
                continue
            with open(entry.path, "rb") as f:
                fields = _parse(f.read(HEADER_BYTES), identity)
        except OSError:
            continue
        if fields is None or fields[0] != key or stat.st_size != HEADER_BYTES + fields[1]:
            continue
        found.append((key, fields[1], stat.st_mtime))
    return found


def remove(directory: str | os.PathLike[str], key: bytes) -> bool:
    """Delete the block `key` from `directory`; False when it was not there."""
    try:
        block_path(directory, key).unlink()
    except FileNotFoundError:
        return False
    return True


def remove_stale_temporaries(directory: str | os.PathLike[str], older_than_s: float) -> int:
    """Delete temporaries a killed writer left (older than `older_than_s`: a live writer's
    are recent); how many went."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not _is_temporary(entry.name):
            continue
        try:
            if time.time() - entry.stat(follow_symlinks=False).st_mtime > older_than_s:
                os.unlink(entry.path)
                removed += 1
        except OSError:
            continue
    return removed


def _is_temporary(name: str) -> bool:
    """`.<key hex>.kv.<pid>-<thread>.tmp`: what `write` renames into place."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX) and SUFFIX + "." in name


def _parse(header: bytes, identity: bytes) -> tuple[bytes, int, bytes] | None:
    """(key, payload length, checksum) of a header of ours under `identity`, else None."""
    if len(header) != HEADER_BYTES:
        return None
    magic, version, _, file_identity, key, nbytes, checksum = _HEADER.unpack(header)
    if magic != MAGIC or version != VERSION or file_identity != identity:
        return None
    return key, nbytes, checksum


def _key_of_name(name: str) -> bytes | None:
    """The key a file name `<64 hex>.kv` stands for, else None (not one of ours)."""
    stem = name.removesuffix(SUFFIX)
    if stem == name or len(stem) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def _check_bytes(name: str, value: bytes, length: int) -> None:
    if not isinstance(value, bytes) or len(value) != length:
        raise ValueError(f"a KV block's {name} must be {length} bytes, got {value!r:.80}.")
