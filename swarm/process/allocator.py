"""Keeps the C allocator from handing megabyte buffers back to the kernel after every message.

glibc serves each allocation above its mmap threshold (128 KiB at first) with fresh pages from the
kernel and unmaps them on free, so every buffer of a tensor on the wire was zero-filled page by page
again: encoding a 4 MiB tensor into its parts took 3.5 ms instead of 0.2 ms on these machines
(`scripts/bench_transport.py`). Raising the thresholds keeps such buffers in the process's heap for
reuse; the process keeps its peak memory instead of returning it, which a long-running peer reaches
anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit systems
TRIM_THRESHOLD = 256 * 2**20


def keep_large_buffers() -> bool:
    """Raises glibc's mmap and trim thresholds; False where the C library is not glibc (nothing changes)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not done:
        logger.debug("mallopt refused the allocator thresholds; large buffers stay on mmap")
    return done
