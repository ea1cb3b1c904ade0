"""Giving the C heap's free memory back to the operating system.

glibc's malloc keeps memory a thread freed in that thread's arena for reuse, and serves allocations above the
(dynamic) mmap threshold from the arenas too once a large block was freed (mallopt(3), "M_MMAP_THRESHOLD").
The agent's periodic jobs (a rebalancer round's matrices, a checkpoint's arrays) allocate tens of MB for a moment
and free them; without a trim that memory stays in the process's RSS. ``malloc_trim(0)`` returns the free pages
of every arena (glibc >= 2.8); it takes well under a millisecond. Elsewhere (musl, other libcs) it is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import logging

from .libc import LIBC

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim():
    fn = getattr(LIBC, "malloc_trim", None)
    if fn is None:  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Return the heap's free pages to the OS; False where the C library cannot (nothing done)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


M_MMAP_THRESHOLD = -3  # mallopt(3) parameter number (glibc malloc.h)
MMAP_THRESHOLD_BYTES = 256 << 10


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve allocations of ``nbytes`` and more with their own mmap, returned to the OS when freed, for the life
    of the process. glibc raises its mmap threshold (up to 32 MB) each time such a block is freed, after which
    the agent's MB-sized temporaries (a block sealed, a checkpoint's arrays) come from the arenas and the holes
    they leave stay resident: malloc_trim gets few of them back. At 1,000 containers that is ~30 MB of RSS
    within 3 min (measured side by side with and without: 131 -> 100 MB), at no measurable CPU. False where
    not glibc."""
    fn = getattr(LIBC, "mallopt", None)
    if fn is None:  # not glibc
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return bool(fn(M_MMAP_THRESHOLD, nbytes))


M_ARENA_MAX = -8  # mallopt(3) parameter number (glibc malloc.h)
MALLOC_ARENAS = 2


def limit_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Let the threads started from now on share at most ``arenas`` malloc arenas, for the life of the process.
    glibc gives a thread that finds the arenas busy an arena of its own, up to 8 per core (mallopt(3),
    "M_ARENA_MAX"); memory a thread frees stays in its arena for that arena's next allocations only, so each
    arena holds its own peak and its own holes. The agent runs a thread per collector and loop (about ten): at
    1,000 containers that was ten arenas holding ~35 MB of which several MB were free. The threads take the GIL
    for nearly all their allocations, so sharing an arena costs them little waiting. Call before the threads
    start (an arena a thread already has stays its own). False where not glibc."""
    fn = getattr(LIBC, "mallopt", None)
    if fn is None:  # not glibc
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return bool(fn(M_ARENA_MAX, arenas))

