"""The relay's event-loop thread: ahead of ordinary work on the CPU, never a real-time task.

Why: every forwarded call wakes the relay's event loop twice (the request, then the answer). On a busy node a
woken relay waited behind whatever ran on its CPU. Traced here (``perf sched record`` under bench/relay_bench.py
phase 2, 2-vCPU VM, HZ=250): a CPU-bound task woken by its timer preempted the relay (or the runtime's thread the
relay had just woken) and ran to the next tick, up to 4 ms, while the other CPU went idle without pulling the
waiting thread over (a recently run task is "cache hot" to the load balancer). Those stalls were the relay's added
p99. Two per-thread settings, made in one ``sched_setattr(2)`` call:

- **nice** (default -10, ``relay.event_loop_nice``): the thread's weight. A woken thread of higher weight gets an
  earlier virtual deadline, so it preempts a nice-0 task at once instead of queueing, and is rarely preempted
  itself. The relay uses ~0.3 ms of CPU a call, so the weight changes when it runs, not how much CPU it takes from
  others; a runaway event loop is still one thread, bounded at ~90% of one CPU against a nice-0 task (weights 9548
  to 1024, kernel/sched/core.c sched_prio_to_weight). Same-run A/B (relay at nice 0 and -10 in alternating chunks
  of 250 calls, bench load): added p99 +1.39 -> +0.23 ms and +0.29 -> +0.20 ms (docs/relay.md).
- **slice** (``EVENT_LOOP_SLICE_NS``): a SCHED_OTHER task's own slice (``sched_attr.sched_runtime``, honoured since
  Linux 6.12: "sched/eevdf: Allow shorter slices to wakeup-preempt"). A shorter slice gives an earlier deadline
  too, for at most that slice at a time. Older kernels accept and ignore the field.

Only the calling thread changes (nice, policy and slice are per thread on Linux): the relay's other threads (pool
updates, reconcile, persist) keep the nice they were started with. A policy other than SCHED_OTHER set by the
operator (e.g. with ``chrt``) is left alone. Lowering nice needs CAP_SYS_NICE (or RLIMIT_NICE): without it the
slice is still set and the result says why the nice was not.

sched_setattr(2) / sched_getattr(2); struct sched_attr as in include/uapi/linux/sched/types.h
(SCHED_ATTR_SIZE_VER0: 48 bytes).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from dataclasses import dataclass

from ..libc import LIBC

# include/uapi/linux/sched/types.h, up to sched_period (SCHED_ATTR_SIZE_VER0):
# size, sched_policy, sched_flags, sched_nice, sched_priority, sched_runtime, sched_deadline, sched_period
_SCHED_ATTR = struct.Struct("=IIQiIQQQ")
assert _SCHED_ATTR.size == 48
SCHED_OTHER = 0
# arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h (arm64)
_NR = {"x86_64": (314, 315), "aarch64": (274, 275)}  # (sched_setattr, sched_getattr)
# kernel/sched/fair.c clamps a custom slice to [0.1 ms, 100 ms]
MIN_SLICE_NS, MAX_SLICE_NS = 100_000, 100_000_000
MIN_NICE, MAX_NICE = -20, 19


@dataclass(frozen=True)
class Priority:
    """What the kernel holds for the calling thread afterwards, read back: its nice and its slice (0: the
    kernel's default, or could not be read); ``error`` names what was asked for and not granted ("" when all
    was)."""

    nice: int
    slice_ns: int
    error: str = ""

    def describe(self) -> str:
        got = f"nice {self.nice}, slice {self.slice_ns / 1e6:g} ms" if self.slice_ns else f"nice {self.nice}"
        return got + (f" ({self.error})" if self.error else "")


def _get(nr_get: int) -> tuple[int, ...] | None:
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if LIBC.syscall(ctypes.c_long(nr_get), ctypes.c_int(0), buf, ctypes.c_uint(_SCHED_ATTR.size),
                    ctypes.c_uint(0)) != 0:
        return None
    return _SCHED_ATTR.unpack(buf.raw)


def _set(nr_set: int, nice: int, slice_ns: int) -> int:
    """0, or the errno of a refused sched_setattr."""
    attr = ctypes.create_string_buffer(_SCHED_ATTR.pack(_SCHED_ATTR.size, SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0))
    if LIBC.syscall(ctypes.c_long(nr_set), ctypes.c_int(0), attr, ctypes.c_uint(0)) != 0:
        return ctypes.get_errno()
    return 0


def prioritise(nice: int, slice_ns: int) -> Priority:
    """Give the calling thread ``nice`` and a ``slice_ns`` scheduler slice (SCHED_OTHER). Never raises: what the
    kernel or the policy refuses is left as it was, and said in the result."""
    current = os.getpriority(os.PRIO_PROCESS, 0)  # the calling thread's (Linux: nice is per thread)
    nrs = _NR.get(platform.machine())
    if nrs is None:
        return Priority(current, 0, f"no sched_setattr number for {platform.machine()}")
    nr_set, nr_get = nrs
    attr = _get(nr_get)
    if attr is None:
        return Priority(current, 0, f"sched_getattr: {os.strerror(ctypes.get_errno())}")
    if attr[1] != SCHED_OTHER:  # a real-time or batch policy set by the operator is theirs to keep
        return Priority(current, 0, f"scheduling policy {attr[1]} is not SCHED_OTHER: left as it is")
    nice = max(MIN_NICE, min(MAX_NICE, nice))
    slice_ns = max(MIN_SLICE_NS, min(MAX_SLICE_NS, slice_ns))
    error = ""
    err = _set(nr_set, nice, slice_ns)
    if err in (errno.EPERM, errno.EACCES) and nice < current:
        # Lowering nice needs CAP_SYS_NICE; the slice does not: keep the nice, take the slice.
        error = f"nice {nice} refused ({os.strerror(err)}: needs CAP_SYS_NICE), kept {current}"
        err = _set(nr_set, current, slice_ns)
    if err:
        return Priority(os.getpriority(os.PRIO_PROCESS, 0), 0,
                        (error + "; " if error else "") + f"sched_setattr: {os.strerror(err)}")
    after = _get(nr_get)
    return Priority(os.getpriority(os.PRIO_PROCESS, 0), after[5] if after is not None else 0, error)
