"""Process-level tuning for the CPU path: glibc malloc and intra-op thread pinning."""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from services.common.cpu_cores import allowed_cpus, one_per_core

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, opened by glibc's soname, else the process's own symbols (which
    hold the libc it links). Never ctypes.util.find_library: it spawns `ldconfig -p`,
    a fork of a process that may already hold gigabytes of weights."""
    for name in ("libc.so.6", None):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def tune_malloc() -> bool:
    """Keep freed memory in glibc's heap (mmap threshold 32 MiB, no trimming).

    The attention path allocates multi-MiB buffers every layer; by default glibc serves
    them with fresh mmap pages each time, and the page faults slow the grouped attention.
    Returns False where glibc is absent.
    """
    libc = _libc()
    if not sys.platform.startswith("linux") or libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024**2)
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 2**30)
        ok &= libc.mallopt(_M_TOP_PAD, 256 * 1024**2)
    except AttributeError:
        return False
    if not ok:
        logger.debug("mallopt refused the CPU tuning")
    return bool(ok)


def return_freed_memory() -> bool:
    """Hands the heap's freed pages back to the system now (glibc's malloc_trim, which
    `tune_malloc`'s trim threshold otherwise defers): after a model load, which frees the
    decoded checkpoint tensors once they are packed. True when pages were released;
    False where glibc is absent."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def thread_cpus() -> list[int]:
    """The CPUs for torch's intra-op threads, one logical CPU per physical core of the
    affinity mask (an mp rank's share, --cpu-cores) when the threads fill it ([] when
    fewer threads than cores: another process may be using the rest, and pinning both to
    the same first cores would halve each, so the OS places them)."""
    cores = one_per_core(allowed_cpus())
    threads = torch.get_num_threads()
    if threads < len(cores):
        return []
    return cores[:threads]


def pin_threads(bind: str = "auto") -> list[int]:
    """Pins torch's intra-op thread i to CPU i of `thread_cpus()` (and sets that many
    threads), so the OS never stacks two compute threads on a core or moves them between
    cores mid-step. Needs the C++ CPU kernels (pagestream_kernels/cpu); returns the CPUs
    pinned to, [] when nothing was pinned (`bind` "none": --cpu-threads-bind, no
    compiler, not Linux)."""
    if bind == "none" or not sys.platform.startswith("linux"):
        return []
    cpus = thread_cpus()
    if not cpus:
        return []
    from pagestream_kernels import cpu as cpu_kernels

    try:
        module = cpu_kernels.load()
    except RuntimeError as exc:
        logger.info("intra-op threads not pinned: %s", exc)
        return []
    torch.set_num_threads(len(cpus))
    pinned = module.pin_threads(cpus)
    if pinned != len(cpus):
        logger.warning("pinned %d of %d intra-op threads", pinned, len(cpus))
    logger.info("intra-op threads pinned to CPUs %s", cpus)
    return cpus
