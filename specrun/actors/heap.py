"""The worker's C heap: its free pages go back to the OS at each checkpoint (glibc's malloc_trim), so that a long
generation's RSS is what it uses. A no-op where the C library has no malloc_trim (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Release the heap's free pages: malloc keeps what a long generation's temporaries of every size freed (a worker
    2,956 tokens into a 45K context held 0.55 GB so, docs/benchmarks.md). -> whether malloc_trim ran."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
