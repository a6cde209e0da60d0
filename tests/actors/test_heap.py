"""trim_heap hands the C heap's free pages back to the OS, and a worker calls it at its checkpoints."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from specrun.actors.heap import trim_heap
from specrun.decoding.stats import rss_mb

BLOCK = 64 * 1024  # under glibc's mmap threshold: from the heap


def test_trim_heap_gives_freed_heap_pages_back():
    """256 MB of heap blocks freed but for every 64th (the heap cannot shrink from its top past them): RSS stays up
    until trim_heap, then falls by most of it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "malloc_trim") or rss_mb() is None:
        pytest.skip("no glibc malloc_trim or no /proc here")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(4096)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)  # resident
    for i, b in enumerate(blocks):
        if i % 64:
            libc.free(b)
    try:
        before = rss_mb()
        assert trim_heap()
        after = rss_mb()
    finally:
        for b in blocks[::64]:
            libc.free(b)
    assert before - after > 128, (before, after)
