"""Process-level tuning for the CPU path."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_malloc() -> bool:
    """Keep freed memory in glibc's heap (mmap threshold 32 MiB, no trimming).

    The attention path allocates multi-MiB buffers every layer; by default glibc serves
    them with fresh mmap pages each time, and the page faults cost up to 1.3x on the
    grouped attention (benchmarks/attention_cpu.py). Returns False where glibc is absent.
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
