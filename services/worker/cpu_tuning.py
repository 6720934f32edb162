"""Process-level tuning for the CPU path: glibc malloc and intra-op thread pinning."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

import torch

from services.common.cpu_cores import CPU_CORES_ENV, allowed_cpus, one_per_core

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_malloc() -> bool:
    """Keep freed memory in glibc's heap (mmap threshold 32 MiB, no trimming).

    The attention path allocates multi-MiB buffers every layer; by default glibc serves
    them with fresh mmap pages each time, and the page faults slow the grouped attention.
    Returns False where glibc is absent.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024**2)
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 2**30)
        ok &= libc.mallopt(_M_TOP_PAD, 256 * 1024**2)
    except (OSError, AttributeError):
        return False
    if not ok:
        logger.debug("mallopt refused the CPU tuning")
    return bool(ok)


def return_freed_memory() -> bool:
    """Hands the heap's freed pages back to the system now (glibc's malloc_trim, which
    `tune_malloc`'s trim threshold otherwise defers): after a model load, which frees the
    decoded checkpoint tensors once they are packed (330 MB of a 1.5B Q4_K_M model's load,
    measured). True when pages were released; False where glibc is absent."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


# "0" leaves the threads where the OS puts them.
CPU_PIN_ENV = "PAGESTREAM_CPU_PIN"


def thread_cpus() -> list[int]:
    """The CPUs for torch's intra-op threads, one logical CPU per physical core: the
    cores of $PAGESTREAM_CPU_CORES (the mp launcher's share for a rank), else of the
    affinity mask when the threads fill it ([] when fewer threads than cores: another
    process may be using the rest, and pinning both to the same first cores would halve
    each, so the OS places them)."""
    cores = one_per_core(allowed_cpus())
    threads = torch.get_num_threads()
    if CPU_CORES_ENV not in os.environ and threads < len(cores):
        return []
    return cores[:threads]


def pin_threads() -> list[int]:
    """Pins torch's intra-op thread i to CPU i of `thread_cpus()` (and sets that many
    threads), so the OS never stacks two compute threads on a core or moves them between
    cores mid-step. Needs the C++ CPU kernels (pagestream_kernels/cpu); returns the CPUs pinned to,
    [] when nothing was pinned ($PAGESTREAM_CPU_PIN=0, no compiler, not Linux)."""
    if os.environ.get(CPU_PIN_ENV, "1") == "0" or not sys.platform.startswith("linux"):
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
