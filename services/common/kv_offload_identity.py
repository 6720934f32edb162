"""The model's KV identity: what must be equal for a saved KV block to be reusable.

A sha256 over the model's files (config.json's bytes; per weight file its name, size and
the sha256 of its first and last MiB: ~2 MiB read per file however large it is), the
draft model's files when speculative decoding runs one (its cache is part of a block),
the weights' dtype and quantization, the KV cache's dtype, the block size, the KV layout
(layers, KV heads, head dim) and the tensor / pipeline parallel sizes. Equal across
restarts of the same model with the same settings, different otherwise. Both the
scheduler (its index: `scan` the directory) and the worker (its store) compute it from
the configs and the worker's ModelInfo (Describe). A rank of a worker group holds its own
shard of each block: ranks other than 0 get their own identity and directory
(`for_rank`), rank 0's is the model's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from services.common import kv_cache_dtype
from services.common.config import CacheConfig, ModelConfig
from services.common.gguf_conversion import TEXT_GGUF_FILE
from services.common.model_source import gguf_source, resolve_model
from services.common.worker_info import ModelInfo

# Bumped when what the identity covers changes (old directories are then never read).
IDENTITY_VERSION = 1
DESCRIPTION_FILE = "identity.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
_EDGE_BYTES = 1 << 20  # the head and tail of a weight file that are hashed


@dataclass(frozen=True)
class KVOffloadIdentity:
    digest: bytes  # 32 bytes: in every block file's header
    description: dict[str, object]  # what it covers, for humans (identity.json)

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def directory(self, root: str | os.PathLike[str]) -> Path:
        """Its blocks' folder under --kv-offload-dir: `<root>/<digest hex[:32]>`."""
        return Path(root) / self.hex[:32]

    def for_rank(self, rank: int) -> KVOffloadIdentity:
        """Rank `rank`'s identity: rank 0 keeps the model's, another rank's digest mixes
        its rank in (its shard of a block is other bytes in another folder)."""
        if rank == 0:
            return self
        digest = hashlib.sha256(self.digest + f"rank {rank}".encode()).digest()
        return KVOffloadIdentity(digest, {**self.description, "rank": rank})

    def prepare(self, root: str | os.PathLike[str]) -> Path:
        """Create its folder and identity.json (written once; atomically) and return it."""
        folder = self.directory(root)
        folder.mkdir(parents=True, exist_ok=True)
        description = folder / DESCRIPTION_FILE
        if not description.is_file():
            tmp = folder / f".{DESCRIPTION_FILE}.{os.getpid()}.tmp"
            body = {"digest": self.hex, **self.description}
            tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, description)
        return folder


def kv_offload_identity(
    model_config: ModelConfig, cache_config: CacheConfig, info: ModelInfo
) -> KVOffloadIdentity:
    """The identity of `model_config`'s KV blocks as `info` (the worker's Describe)
    lays them out with `cache_config`'s block size and KV dtype."""
    files = model_fingerprint(model_config.model)
    speculative = model_config.speculative
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = model_fingerprint(str(speculative.model))
    description: dict[str, object] = {
        "version": IDENTITY_VERSION,
        "model": model_config.model,
        "files": files,
        "draft_model_files": draft,
        "dtype": info.dtype,
        "quantization": [model_config.quantization, model_config.quantization_group_size],
        "kv_cache_dtype": kv_cache_dtype.canonical(cache_config.cache_dtype),
        "block_size": cache_config.block_size,
        "kv_layout": [info.num_layers, info.num_kv_heads, info.head_dim],
        "parallel": [info.tensor_parallel_size, info.pipeline_parallel_size],
    }
    # The files, not where they are: a moved or renamed folder keeps its blocks.
    covered = {name: value for name, value in description.items() if name != "model"}
    canonical = json.dumps(covered, sort_keys=True, separators=(",", ":")).encode()
    return KVOffloadIdentity(hashlib.sha256(canonical).digest(), description)


def model_fingerprint(model: str) -> dict[str, object]:
    """The model's files as the identity sees them: config.json's sha256 and per weight
    file (the HF folder's, the GGUF file its weights stay in) name, size and edges."""
    folder = resolve_model(model)
    weights = sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    for linked in (gguf_source(model), _pair_text_gguf(folder)):
        if linked is not None and linked not in weights:
            weights.append(linked)
    config = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    return {"config": config, "weights": [file_fingerprint(p) for p in weights]}


def file_fingerprint(path: Path) -> list[object]:
    """[name, size, sha256 of the first MiB, sha256 of the last MiB]: a changed file
    almost always changes its size, header or tail, and reading 2 MiB of a multi-GB file
    costs milliseconds (a weight byte in the middle is not seen: the name and size say
    which file, the edges catch a re-export)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(_EDGE_BYTES)).hexdigest()
        f.seek(max(0, size - _EDGE_BYTES))
        tail = hashlib.sha256(f.read(_EDGE_BYTES)).hexdigest()
    return [path.name, size, head, tail]


def _pair_text_gguf(folder: Path) -> Path | None:
    """The text GGUF a converted pair's folder reads its weights from (its record), if any."""
    record = folder / TEXT_GGUF_FILE
    if not record.is_file():
        return None
    try:
        path = Path(json.loads(record.read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if path.is_file() else None
