"""The C++ CPU kernel extension (cpu/*.cpp), built on first use by torch's extension loader.

`paged_attention` and `reshape_and_cache` have reference.py's signatures: decode groups run
paged_decode.cpp (each cached key and value read once, through the block table), prefill
groups the reference's masked SDPA, for float32 or bfloat16 queries over float32,
bfloat16 or q8_0 (uint8) caches (a bfloat16 query over a float32 cache takes the reference
path). The
extension also holds the row kernels (norms, activations, rotary, cache writes) that the
torch modules' ops (`fused_ops`) and the native decode step (services/worker/native_step.py)
share, the linears, and the thread team and its pinning.

The build is keyed by the sources, the torch version and this CPU's instruction-set flags
(-march=native), so a shared $PAGESTREAM_CACHE never runs code built for another CPU.
`unavailable_reason()` says why it cannot be built here; "auto" then uses the torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

import torch

from pagestream_kernels.attention_metadata import AttentionMetadata
from pagestream_kernels.reference import AttentionOptions, planned_attention
from pagestream_kernels.reference import reshape_and_cache as reference_reshape_and_cache
from services.common.cache_dir import cache_dir

logger = logging.getLogger(__name__)

_FOLDER = Path(__file__).parent
SOURCES = tuple(sorted(_FOLDER.glob("*.cpp")))
HEADERS = tuple(sorted(_FOLDER.glob("*.h")))
_lock = threading.Lock()
_state: dict = {}  # "module" once built, or "error" (the reason it cannot be)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def _extension_name() -> str:
    key = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    key += torch.__version__.encode() + _cpu_flags().encode()
    return "pagestream_cpu_kernels_" + hashlib.sha256(key).hexdigest()[:12]


def _build_directory(name: str) -> Path:
    folder = cache_dir() / "torch_extensions" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _put_ninja_on_path() -> None:
    """The `ninja` wheel's binary, for a venv whose bin/ is not on PATH."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


# A build lock older than this was left by a process killed mid-build (torch's file lock
# would otherwise make every later process wait for it forever).
STALE_LOCK_S = 600.0


def _load_built(name: str, folder: Path):
    """The module already built in `folder` (its name hashes the source, torch and CPU
    flags), loaded without torch's build lock; None when there is none or it is broken."""
    path = folder / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        logger.warning("cannot load %s (%s): building it again", path, exc)
        return None
    return module


def _clear_stale_lock(folder: Path) -> None:
    lock = folder / "lock"
    with contextlib.suppress(FileNotFoundError):
        age = time.time() - lock.stat().st_mtime
        if age > STALE_LOCK_S:
            logger.warning("removing a build lock left %.0f s ago in %s", age, folder)
            lock.unlink()


def _build():
    from torch.utils import cpp_extension

    name = _extension_name()
    folder = _build_directory(name)
    logger.info("loading the C++ CPU kernels from %s (built there on first use)", folder)
    module = _load_built(name, folder)
    if module is not None:
        return module
    _put_ninja_on_path()
    _clear_stale_lock(folder)
    logger.warning(
        "compiling the C++ CPU kernels into %s: about 2 minutes on 2 cores, once per source "
        "version and CPU (`make setup` does it ahead of time)",
        folder,
    )
    return cpp_extension.load(
        name=name,
        sources=[str(source) for source in SOURCES],
        build_directory=str(folder),
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def load():
    """The built extension module (built on first call); raises RuntimeError if it can't be."""
    module = _state.get("module")
    if module is not None:  # every layer of every step asks: no lock once it is built
        return module
    with _lock:
        if "module" not in _state and "error" not in _state:
            try:
                _state["module"] = _build()
            except Exception as exc:  # compiler, ninja, headers: any build failure
                _state["error"] = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        if "error" in _state:
            raise RuntimeError(f"the C++ CPU kernel extension cannot be built: {_state['error']}")
        return _state["module"]


def unavailable_reason() -> str | None:
    try:
        load()
    except RuntimeError as exc:
        return str(exc)
    return None


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    options: AttentionOptions,
) -> torch.Tensor:
    """Decode rows [B, q_heads, head_dim] over the paged cache -> [B, q_heads, head_dim]."""
    query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)  # empty_like would copy odd strides
    load().paged_decode(
        out,
        query,
        kv_cache[0],
        kv_cache[1],
        block_table,
        seq_lens,
        options.scale,
        options.sliding_window or 0,
        options.soft_cap or 0.0,
    )
    return out


_KERNEL_DTYPES = {
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.uint8),  # uint8: q8_0 rows (pagestream_kernels/q8_0.py)
    (torch.bfloat16, torch.uint8),
}


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel takes this query over this cache (else the torch path)."""
    return (
        query.device.type == "cpu"
        and kv_cache.is_contiguous()
        and (query.dtype, kv_cache.dtype) in _KERNEL_DTYPES
    )


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """reference.reshape_and_cache in one C++ pass where the kernel takes the
    tensors (CPU, float32/bfloat16 rows into a float32/bfloat16 or q8_0 cache), else the
    reference."""
    fits = (
        key.device.type == "cpu"
        and kv_cache.is_contiguous()
        and (key.dtype, kv_cache.dtype) in _KERNEL_DTYPES
        and key.stride(-1) == value.stride(-1) == 1
        and key.stride(1) == key.shape[2]
        and value.stride(1) == value.shape[2]
    )
    if not fits:
        reference_reshape_and_cache(key, value, kv_cache, slot_mapping)
        return
    load().cache_write(key, value, kv_cache, slot_mapping)


def _all_decode(query: torch.Tensor, metadata: AttentionMetadata) -> bool:
    """One query row per sequence (a pure decode step), from the metadata's host ints: at
    most one row each and as many rows as sequences means exactly one each (no tensor op,
    so nothing per layer on the step's path)."""
    return metadata.max_query_len == 1 and query.shape[0] == metadata.num_seqs


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """reference.paged_attention with decode groups in C++ (CPU tensors, see above)."""
    options = AttentionOptions(scale, sliding_window, soft_cap)
    block_table, seq_lens = metadata.block_table, metadata.seq_lens
    kernel = paged_decode if supports(query, kv_cache) else None
    if kernel is not None and _all_decode(query, metadata):
        # every sequence has one query row, in order: one call, no planning or regrouping
        tables = block_table.to(torch.int32).contiguous()
        return kernel(query, kv_cache, tables, seq_lens.to(torch.int32), options)
    return planned_attention(query, kv_cache, metadata, options, kernel)
