"""Per-CPU busy time and utilisation from ``/proc/stat``.

Format: Documentation/filesystems/proc.rst, "1.7 Miscellaneous kernel statistics in /proc/stat":
``cpuN user nice system idle iowait irq softirq steal guest guest_nice`` in USER_HZ ticks.
``guest`` and ``guest_nice`` are already included in ``user`` and ``nice`` (kernel/sched/cputime.c,
account_guest_time), so they are not added again. Busy = everything except idle and iowait.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import metrics as M
from ..store import Sample
from ..topology import Topology
from .base import Collector, CollectorUnavailable, Probe


@dataclass(frozen=True)
class CpuTimes:
    busy_ticks: int
    idle_ticks: int


def parse_proc_stat(text: str) -> dict[int, CpuTimes]:
    out: dict[int, CpuTimes] = {}
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        parts = line.split()
        try:
            cpu = int(parts[0][3:])
            f = [int(x) for x in parts[1:]]
        except ValueError:
            continue
        f += [0] * (8 - len(f))
        user, nice, system, idle, iowait, irq, softirq, steal = f[:8]
        out[cpu] = CpuTimes(user + nice + system + irq + softirq + steal, idle + iowait)
    return out


class CpuCollector(Collector):
    name = "cpu"

    def __init__(self, proc_root: Path, topology: Topology, ticks_per_second: int | None = None):
        self.proc_root = Path(proc_root)
        self.topology = topology
        self.hz = ticks_per_second or os.sysconf("SC_CLK_TCK")
        self._prev: dict[int, CpuTimes] = {}

    def probe(self) -> Probe:
        if not (self.proc_root / "stat").exists():
            return Probe(False, f"{self.proc_root / 'stat'} not found")
        return Probe(True)

    def collect(self, now: float) -> list[Sample]:
        try:
            text = (self.proc_root / "stat").read_text()
        except OSError as e:
            raise CollectorUnavailable(f"cannot read {self.proc_root / 'stat'}: {e.strerror}") from None
        cur = parse_proc_stat(text)
        samples = []
        for cpu, t in sorted(cur.items()):
            lab = self.topology.cpu_labels(cpu)
            samples.append(Sample(M.CPU_BUSY.name, lab, t.busy_ticks / self.hz))
            p = self._prev.get(cpu)
            if p is not None:
                db, di = t.busy_ticks - p.busy_ticks, t.idle_ticks - p.idle_ticks
                if db >= 0 and di >= 0 and db + di > 0:
                    samples.append(Sample(M.CPU_UTILIZATION.name, lab, db / (db + di)))
        self._prev = cur
        return samples
