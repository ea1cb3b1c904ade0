"""The C library, for the calls Python's ``os`` module lacks: perf_event_open(2) and sched_setattr(2) through
syscall(2), inotify(7), open_by_handle_at(2), and glibc's malloc_trim/mallopt. One handle for the process (the
symbols already loaded into it: ``dlopen(NULL)``), with errno kept for ``ctypes.get_errno()``. A function a libc
does not have (musl has no malloc_trim) is simply absent: callers look it up with ``getattr(LIBC, name, None)``.
Each function's ``argtypes``/``restype`` is set by the one module that calls it."""

from __future__ import annotations

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
