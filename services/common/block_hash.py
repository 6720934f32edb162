"""Chained block hashes for prefix caching: pure functions, sha256, canonical encoding.

A block's hash covers its parent's hash, its token ids and optional extra keys (the
request's cache_salt and its LoRA adapter's identity in block 0, the content hash of
every image whose placeholder span touches the block), so equal hashes mean equal
prefixes computed by equal weights from equal inputs. Never Python's
hash(): its collisions would let one request read another's KV cache.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from services.common.image_input import ImageInput, images_in_block

BlockHash = bytes

_ROOT = b"pagestream-block-v1"


def _encode_extra_keys(extra_keys: Sequence[str | int] | None) -> bytes:
    if not extra_keys:
        return b"\x00"
    parts = []
    for key in extra_keys:
        raw = key.encode() if isinstance(key, str) else str(int(key)).encode()
        tag = b"s" if isinstance(key, str) else b"i"
        parts.append(tag + struct.pack("<I", len(raw)) + raw)
    return b"\x01" + b"".join(parts)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | int] | None = None,
) -> BlockHash:
    """sha256(parent || len || tokens as little-endian int64 || extra keys)."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else _ROOT)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    known: Sequence[BlockHash] = (),
    cache_salt: str | None = None,
    lora_identity: str | None = None,
    images: tuple[ImageInput, ...] = (),
) -> list[BlockHash]:
    """Hashes of every full block of token_ids, reusing the already known prefix of them."""
    hashes = list(known)
    first_keys = first_block_keys(cache_salt, lora_identity)
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        start, end = i * block_size, (i + 1) * block_size
        extra = (first_keys if i == 0 else ()) + images_in_block(images, start, end)
        hashes.append(hash_block_tokens(parent, token_ids[start:end], extra))
    return hashes


def first_block_keys(cache_salt: str | None, lora_identity: str | None) -> tuple[str, ...]:
    """Block 0's extra keys: (salt,) alone, or (salt or "", adapter) with a LoRA adapter
    (two keys, so no salt can spell an adapter's blocks)."""
    if lora_identity:
        return (cache_salt or "", "lora=" + lora_identity)
    return (cache_salt,) if cache_salt else ()
