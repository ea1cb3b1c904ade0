"""Build fake cgroup trees in the kernel's file formats (Documentation/admin-guide/cgroup-v2.rst,
cgroup-v1/{cpuacct,memory,cpusets}.rst, scheduler/sched-bwc.rst)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Values:
    usage_ns: int = 5_000_000_000
    periods: int = 100
    throttled: int = 7
    throttled_ns: int = 250_000_000
    mem: int = 100 * 2**20
    inactive_file: int = 30 * 2**20
    cpus: str = "0-1"


def _w(p: Path, text: str) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def make_v2(root: Path, rel: str, v: Values) -> None:
    d = root / rel.strip("/")
    _w(root / "cgroup.controllers", "cpuset cpu io memory pids\n")
    _w(d / "cpu.stat", f"usage_usec {v.usage_ns // 1000}\nuser_usec 1\nsystem_usec 1\n"
                       f"nr_periods {v.periods}\nnr_throttled {v.throttled}\nthrottled_usec {v.throttled_ns // 1000}\n")
    _w(d / "memory.current", f"{v.mem}\n")
    _w(d / "memory.stat", f"anon 1\nfile 2\ninactive_anon 0\nactive_anon 1\ninactive_file {v.inactive_file}\n")
    _w(d / "cpuset.cpus.effective", v.cpus + "\n")


def make_v1(root: Path, rel: str, v: Values, combined_cpu_dir: bool = False) -> None:
    rel = rel.strip("/")
    cpuacct = root / ("cpu,cpuacct" if combined_cpu_dir else "cpuacct")
    cpu = root / ("cpu,cpuacct" if combined_cpu_dir else "cpu")
    _w(cpuacct / rel / "cpuacct.usage", f"{v.usage_ns}\n")
    _w(cpu / rel / "cpu.stat", f"nr_periods {v.periods}\nnr_throttled {v.throttled}\nthrottled_time {v.throttled_ns}\n")
    _w(root / "memory" / rel / "memory.usage_in_bytes", f"{v.mem}\n")
    _w(root / "memory" / rel / "memory.stat",
       f"cache 1\nrss 2\ninactive_file 5\ntotal_inactive_file {v.inactive_file}\n")
    _w(root / "cpuset" / rel / "cpuset.effective_cpus", v.cpus + "\n")
    _w(root / "cpuset" / rel / "cpuset.cpus", v.cpus + "\n")
