"""Where slow calls waited for a CPU: the kernel's scheduler events around a benchmark's calls.

``perf sched record`` (Debian's linux-perf; the sched tracepoints, no PMU needed) records every wake-up and
context switch on the machine, on CLOCK_MONOTONIC so that its time stamps and ``time.perf_counter()`` (the
bench's clock) are one clock. From them, for each thread, the intervals in which it was runnable but not on a CPU:
from its ``sched_waking`` (woken) or from a ``sched_switch`` that took it off the CPU still runnable (preempted),
to the ``sched_switch`` that put it back on. A slow call's run-queue wait is then the overlap of those intervals
with the call, summed per group of processes (the relay, the runtime, the client), and who ran meanwhile on the
CPU the waiting thread was queued on.

    with SchedTrace(out_dir) as tr:      # perf sched record -a, stopped on exit
        ... calls, each kept as (target, t0, t1) ...
    report = tr.attribute(calls, groups={"relay": pid, "runtime": pid, "client": os.getpid()}, slower_than=s)
"""

from __future__ import annotations

import bisect
import re
import shutil
import signal
import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_EVENT = re.compile(r"\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)")
_SWITCH = re.compile(r"prev_comm=(.*) prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=(.*) "
                     r"next_pid=(\d+) next_prio=\d+")
_WAKING = re.compile(r"pid=(\d+) prio=\d+ target_cpu=(\d+)")


@dataclass
class Waits:
    """Per thread: (start, end, cpu it waited on) of each run-queue wait; per CPU: the switches (time, pid in)."""

    by_tid: dict[int, list[tuple[float, float, int]]] = field(default_factory=lambda: defaultdict(list))
    tgid: dict[int, int] = field(default_factory=dict)
    comm: dict[int, str] = field(default_factory=dict)
    switches: dict[int, list[tuple[float, int]]] = field(default_factory=lambda: defaultdict(list))


def parse(lines) -> Waits:
    """``perf script -F comm,pid,tid,cpu,time,event,trace`` lines of a ``perf sched record``."""
    w = Waits()
    since: dict[int, tuple[float, int]] = {}
    for line in lines:
        m = _EVENT.match(line)
        if m is None:
            continue
        comm, pid, tid, cpu_s, t_s, ev, rest = m.groups()
        t, cpu = float(t_s), int(cpu_s)
        w.tgid[int(tid)] = int(pid)
        if tid == pid or int(pid) not in w.comm:  # a process by its main thread's name
            w.comm[int(pid)] = comm
        if ev == "sched:sched_waking":
            k = _WAKING.search(rest)
            if k is not None:
                since.setdefault(int(k.group(1)), (t, int(k.group(2))))
        elif ev == "sched:sched_switch":
            s = _SWITCH.search(rest)
            if s is None:
                continue
            prev, state, nxt = int(s.group(2)), s.group(3), int(s.group(5))
            if state.startswith("R"):  # preempted: still runnable
                since[prev] = (t, cpu)
            else:
                since.pop(prev, None)
            start = since.pop(nxt, None)
            if start is not None and nxt != 0:
                w.by_tid[nxt].append((start[0], t, start[1]))
            w.switches[cpu].append((t, nxt))
    return w


class SchedTrace:
    def __init__(self, out_dir: Path):
        self.data = out_dir / "sched.data"
        self.proc: subprocess.Popen | None = None
        self.waits: Waits | None = None

    @staticmethod
    def missing() -> str:
        return "" if shutil.which("perf") else "perf not found (Debian package linux-perf)"

    def __enter__(self) -> SchedTrace:
        self.proc = subprocess.Popen(["perf", "sched", "record", "-k", "CLOCK_MONOTONIC", "-a", "-o",
                                      str(self.data)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf opens its events on every CPU before the calls start
        return self

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        out = subprocess.run(["perf", "script", "-i", str(self.data), "-F", "comm,pid,tid,cpu,time,event,trace"],
                             capture_output=True, text=True, timeout=600).stdout
        self.waits = parse(out.splitlines())
        self.data.unlink(missing_ok=True)

    def attribute(self, calls: list[tuple[str, float, float]], groups: dict[str, int], slower_than: float,
                  names: dict[str, int] | None = None) -> dict[str, tuple[int, Counter, Counter]]:
        """target -> (calls slower than ``slower_than`` s, run-queue wait (s) inside them per group, what ran
        (s) on the CPUs those waits were queued on, by process: a name of ``groups`` or ``names``, else its
        command name and pid)."""
        assert self.waits is not None
        w = self.waits
        group_of = {pid: g for g, pid in groups.items()}
        name_of = {**{pid: n for n, pid in (names or {}).items()}, **group_of}
        waits = sorted((s, e, cpu, group_of[w.tgid.get(tid, tid)]) for tid, ws in w.by_tid.items()
                       if w.tgid.get(tid, tid) in group_of for s, e, cpu in ws)
        starts = [x[0] for x in waits]
        sw_t = {cpu: [x[0] for x in xs] for cpu, xs in w.switches.items()}
        out: dict[str, tuple[int, Counter, Counter]] = {}
        for target, t0, t1 in calls:
            if t1 - t0 <= slower_than:
                continue
            n, per_group, ran = out.get(target, (0, Counter(), Counter()))
            i = bisect.bisect_left(starts, t0 - 0.05)
            for s, e, cpu, g in waits[i:]:
                if s > t1:
                    break
                a, b = max(s, t0), min(e, t1)
                if b <= a:
                    continue
                per_group[g] += b - a
                sw, ts = w.switches[cpu], sw_t[cpu]  # who held that CPU meanwhile
                j = max(bisect.bisect_right(ts, a) - 1, 0)
                while j < len(sw) and sw[j][0] < b:
                    end = sw[j + 1][0] if j + 1 < len(sw) else b
                    pid = w.tgid.get(sw[j][1], sw[j][1])
                    name = "idle" if pid == 0 else name_of.get(pid) or f"{w.comm.get(pid, '?')}[{pid}]"
                    ran[name] += max(0.0, min(end, b) - max(sw[j][0], a))
                    j += 1
            out[target] = (n + 1, per_group, ran)
        return out
