"""Where an NRI hook's time goes, measured on the thread that answers it.

A hook's wall time (request decoded -> answer encoded) splits into parts that add up:

- ``cpu``: the answering thread on a CPU;
- ``runqueue``: the thread runnable but waiting for a CPU (other processes, or the plugin's own threads);
- ``blocked``: the rest, when the thread went to sleep meanwhile — waiting for the interpreter lock while
  another thread of the plugin runs Python, for a lock, or for I/O;
- ``steal``: the rest, when it never did: it was neither on a CPU, nor asleep, nor queued, so its virtual CPU
  was not running (the hypervisor's steal time; /proc/stat's eighth column counts it machine-wide) or was
  handling interrupts.

``cpu`` is the thread's CPU clock (``CLOCK_THREAD_CPUTIME_ID``); ``runqueue`` the second field of its
``schedstat`` (proc(5) ``/proc/[pid]/task/[tid]/schedstat``: time waiting on a run queue, ns;
Documentation/scheduler/sched-stats.rst), read through a descriptor each thread keeps open (``pread``: about
1 µs). The file's first field, time on the CPU, is not used: for a running thread it lags until the next tick.

Besides, over the same interval: the CPU time of the plugin's other threads (``CLOCK_PROCESS_CPUTIME_ID`` minus
the thread's own: did another thread hold the interpreter?), the garbage collector's pauses (``gc.callbacks``,
whatever thread ran them) and the thread's context switches (getrusage(2) ``RUSAGE_THREAD``: voluntary = it
blocked, involuntary = it was preempted).

A hook slower than ``slow_seconds`` is logged with this breakdown and the phases its handler marked
(:meth:`cri_resmgr.nri.ttrpc.Call.mark`), and counted by its largest part (:mod:`.stats`).
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

SLOW_SECONDS = 0.002  # issue 15's target for a hook's p99
GC_PAUSES_KEPT = 256


class GcPause(NamedTuple):
    start: float  # time.monotonic()
    end: float
    generation: int


class GcPauses:
    """The garbage collector's pauses in this process, from ``gc.callbacks`` (called around every collection, on
    the thread that triggers it, with the interpreter held: no lock needed between start and stop)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, kept: int = GC_PAUSES_KEPT):
        self.clock = clock
        self.recent: deque[GcPause] = deque(maxlen=kept)
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        end = self.clock()
        gen = int(info.get("generation", 2))
        self.recent.append(GcPause(self._started, end, gen))
        self.count[gen] += 1
        self.seconds[gen] += end - self._started

    def install(self) -> None:
        if self.callback not in gc.callbacks:
            gc.callbacks.append(self.callback)

    def uninstall(self) -> None:
        if self.callback in gc.callbacks:
            gc.callbacks.remove(self.callback)

    def within(self, t0: float, t1: float) -> float:
        """Seconds of collection inside [t0, t1]."""
        total = 0.0
        # A copy (atomic): another thread's collection may append while this loop runs between bytecodes.
        for p in reversed(tuple(self.recent)):
            if p.end <= t0:
                break
            total += max(0.0, min(p.end, t1) - max(p.start, t0))
        return total


class TraceStart(NamedTuple):
    cpu_ns: int
    runqueue_ns: int
    process_cpu_ns: int
    voluntary: int
    involuntary: int


@dataclass(frozen=True)
class HookTrace:
    event: str
    result: str
    wall_seconds: float
    cpu_seconds: float
    runqueue_seconds: float
    blocked_seconds: float
    steal_seconds: float
    others_cpu_seconds: float  # the plugin's other threads on a CPU meanwhile
    gc_seconds: float
    voluntary_switches: int
    involuntary_switches: int
    phases: tuple[tuple[str, float], ...] = ()

    @property
    def cause(self) -> str:
        """The largest part of a slow hook: ``gc`` when collection took most of it (at least half its time:
        a collection runs on a CPU, so its time is inside ``cpu`` too, and cannot be compared with it), else
        ``cpu``, ``runqueue``, ``blocked`` or ``steal``."""
        parts = {"cpu": self.cpu_seconds, "runqueue": self.runqueue_seconds, "blocked": self.blocked_seconds,
                 "steal": self.steal_seconds}
        if self.gc_seconds > 0 and self.gc_seconds >= 0.5 * self.wall_seconds:
            return "gc"
        return max(parts, key=lambda k: parts[k])

    def describe(self) -> str:
        ms = 1e3
        phases = " ".join(f"{n} {s * ms:.2f}" for n, s in self.phases)
        return (f"{self.event} {self.wall_seconds * ms:.2f} ms: cpu {self.cpu_seconds * ms:.2f}, run queue "
                f"{self.runqueue_seconds * ms:.2f}, blocked {self.blocked_seconds * ms:.2f}, steal "
                f"{self.steal_seconds * ms:.2f} (other threads on a CPU "
                f"{self.others_cpu_seconds * ms:.2f}, GC {self.gc_seconds * ms:.2f}; switches "
                f"{self.voluntary_switches} voluntary, {self.involuntary_switches} involuntary); cause {self.cause}"
                + (f"; phases ms: {phases}" if phases else ""))


class HookTracer:
    """``begin()`` and ``end()`` on the thread that answers a hook."""

    def __init__(self, proc_root: Path = Path("/proc"), gc_pauses: GcPauses | None = None):
        self.proc_root = Path(proc_root)
        self.gc = gc_pauses or GcPauses()
        self._local = threading.local()

    def _runqueue_ns(self) -> int:
        fd: int | None = getattr(self._local, "fd", None)
        if fd is None:
            try:
                fd = os.open(self.proc_root / "thread-self" / "schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = -1  # no CONFIG_SCHED_INFO: run-queue time counts as blocked
            self._local.fd = fd
        if fd >= 0:
            try:
                return int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):
                pass
        return 0

    def begin(self) -> TraceStart:
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        return TraceStart(time.thread_time_ns(), self._runqueue_ns(), time.process_time_ns(), ru.ru_nvcsw, ru.ru_nivcsw)

    def end(self, start: TraceStart, event: str, result: str, t0: float, t1: float,
            phases: tuple[tuple[str, float], ...] = ()) -> HookTrace:
        cpu, proc = time.thread_time_ns(), time.process_time_ns()
        runq = self._runqueue_ns()
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        wall = t1 - t0
        cpu_s = (cpu - start.cpu_ns) / 1e9
        # At most what the CPU time leaves: the kernel stamps run-queue waits with the clock of the CPU the thread
        # was queued on and the one it ran on, which a VM's CPUs may not agree on to the millisecond.
        runq_s = max(0.0, min((runq - start.runqueue_ns) / 1e9, wall - cpu_s))
        own = cpu - start.cpu_ns
        rest = max(0.0, wall - cpu_s - runq_s)
        slept = ru.ru_nvcsw - start.voluntary
        return HookTrace(event, result, wall, cpu_s, runq_s, rest if slept else 0.0, 0.0 if slept else rest,
                         max(0, proc - start.process_cpu_ns - own) / 1e9, self.gc.within(t0, t1),
                         slept, ru.ru_nivcsw - start.involuntary, phases)


def phase_durations(t0: float, marks: list[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """Marks (name, time it ended) from ``t0`` on as (name, seconds) each."""
    out = []
    prev = t0
    for name, t in marks:
        out.append((name, t - prev))
        prev = t
    return tuple(out)
