"""The relay's event-loop thread asks the kernel for a short scheduler slice.

Why: every forwarded call wakes the relay twice (the request, then the answer). On a busy node the woken
relay waited for whatever ran on the CPU to finish its slice: with EEVDF (Linux >= 6.6) that is
``sched_base_slice_ns`` scaled by the CPU count (1.4 ms on 2 CPUs), and each of the relay's two wake-ups per
call could pay it, which is where the relay's added p99 under load came from (bench/relay_bench.py phase 2).

A task's own slice (``sched_attr.sched_runtime`` of a SCHED_OTHER task, honoured since Linux 6.12: the EEVDF
series with "sched/eevdf: Allow shorter slices to wakeup-preempt") gives it an earlier
virtual deadline, so the scheduler runs it first when it wakes, for at most that slice at a time. It does
not change the task's weight (nice): over time the relay gets no more CPU than before, only sooner. The
nice value is passed back unchanged. Older kernels accept and ignore the field: nothing changes there.

sched_setattr(2) / sched_getattr(2); struct sched_attr as in include/uapi/linux/sched/types.h
(SCHED_ATTR_SIZE_VER0: 48 bytes).
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from dataclasses import dataclass

# include/uapi/linux/sched/types.h, up to sched_period (SCHED_ATTR_SIZE_VER0)
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")
assert _SCHED_ATTR.size == 48
SCHED_OTHER = 0
# arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h (arm64)
_NR = {"x86_64": (314, 315), "aarch64": (274, 275)}  # (sched_setattr, sched_getattr)
# kernel/sched/fair.c clamps a custom slice to [0.1 ms, 100 ms]
MIN_SLICE_NS, MAX_SLICE_NS = 100_000, 100_000_000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass(frozen=True)
class SliceResult:
    """What the kernel holds for the calling thread afterwards: ``slice_ns`` as read back (0 when it could not
    be read), ``error`` naming why the request failed (empty when it went through)."""

    slice_ns: int
    error: str = ""


def _get(nr_get: int) -> tuple[int, ...] | None:
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if _libc.syscall(ctypes.c_long(nr_get), ctypes.c_int(0), buf, ctypes.c_uint(_SCHED_ATTR.size),
                     ctypes.c_uint(0)) != 0:
        return None
    return _SCHED_ATTR.unpack(buf.raw)


def request_slice(slice_ns: int) -> SliceResult:
    """Ask for ``slice_ns`` as the calling thread's scheduler slice (SCHED_OTHER, nice kept). Never raises:
    a kernel or policy that refuses it leaves the thread as it was."""
    nrs = _NR.get(platform.machine())
    if nrs is None:
        return SliceResult(0, f"no sched_setattr number for {platform.machine()}")
    nr_set, nr_get = nrs
    current = _get(nr_get)
    if current is None:
        return SliceResult(0, f"sched_getattr: {os.strerror(ctypes.get_errno())}")
    policy = current[1]
    if policy != SCHED_OTHER:  # a real-time or batch policy set by the operator is theirs to keep
        return SliceResult(0, f"scheduling policy {policy} is not SCHED_OTHER: left as it is")
    nice = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's (Linux: nice is per thread)
    slice_ns = max(MIN_SLICE_NS, min(MAX_SLICE_NS, slice_ns))
    attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(_SCHED_ATTR.size, SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0))
    if _libc.syscall(ctypes.c_long(nr_set), ctypes.c_int(0), attr, ctypes.c_uint(0)) != 0:
        return SliceResult(0, f"sched_setattr: {os.strerror(ctypes.get_errno())}")
    after = _get(nr_get)
    return SliceResult(after[5] if after is not None else 0)
