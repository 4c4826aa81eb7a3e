"""How freed host memory is kept: glibc malloc settings for the CPU engine.

Every forward on the CPU allocates its activations anew (a prefill chunk of 2,048 tokens
takes tens of MiB per layer op) and frees them at once. With glibc's defaults, blocks past
a moving mmap threshold are mapped and unmapped per allocation, and freed memory at the top
of the heap is handed back to the kernel once it passes the trim threshold; either way the
next step touches fresh pages, one page fault per 4 KiB. On the offline benchmark's 64
requests a float32 run took 238,000 page faults (20,000 when freed memory is kept: an mmap
threshold of 32 MiB, glibc's largest, and a trim threshold of 1 GiB); standalone bfloat16
runs were 8-15 % faster with it, within the noise of the benchmark's own runs
(docs/benchmarks.md). The memory kept is what the next step allocates again: the largest
step's activations, as a caching allocator would hold them.

The engine applies this once its model is loaded (``ModelRunner``), for CPU devices, unless
the user chose these settings (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or
``GLIBC_TUNABLES``). It changes the whole process's allocator, which is the engine's.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Sets glibc's mmap and trim thresholds (see the module); True if set. False where the
    user set one of ``USER_VARIABLES``, off glibc, or when glibc refuses a value."""
    if any(name in environ for name in USER_VARIABLES) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logging.getLogger("loraplex").warning("glibc refused the engine's malloc thresholds")
    return ok
