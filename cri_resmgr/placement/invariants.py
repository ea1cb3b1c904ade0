"""The placement invariants, checked against what the kernel enforces.

1. No CPU is in two exclusive sets (the engine's books, and the kernel's cpusets of running containers).
2. The shared pool is allocatable minus exclusive minus reserved: no running non-exclusive container's
   cpuset holds a CPU of a running exclusive container.
3. Every running exclusive container's cgroup cpuset equals its allocation.

The kernel's view is the container's ``cpuset.cpus`` (cgroup v1: Documentation/admin-guide/cgroup-v1/cpusets.rst;
v2: Documentation/admin-guide/cgroup-v2.rst "cpuset.cpus"), under the cpuset hierarchy at
``<cgroup root>/cpuset`` (v1) or the unified root (v2), at the path runc gives it (``cgroup_parent/id`` with the
cgroupfs driver).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from ..collectors.cgroup import detect_layout
from ..sysfs import format_cpulist, parse_cpulist
from .model import Container, Kind, State


class Rule(StrEnum):
    BOOKS_OVERLAP = "books-overlap"  # two exclusive allocations in the engine's own books share a CPU
    EXCLUSIVE_OVERLAP = "exclusive-overlap"  # two running exclusive containers' kernel cpusets share a CPU
    SHARED_ON_EXCLUSIVE = "shared-on-exclusive"  # a non-exclusive container runs on an exclusive CPU
    EXCLUSIVE_MISMATCH = "exclusive-mismatch"  # an exclusive container's kernel cpuset is not its allocation


@dataclass(frozen=True)
class Violation:
    rule: Rule
    container_id: str
    detail: str
    other_id: str = ""


@dataclass
class InvariantReport:
    checked: int = 0  # running containers whose kernel cpuset was read
    violations: list[Violation] = field(default_factory=list)
    repaired: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations


class KernelCpusets:
    """Reads a container's cpuset as the kernel holds it."""

    def __init__(self, cgroup_root: Path):
        self.cgroup_root = Path(cgroup_root)
        self._base: Path | None = None

    def base(self) -> Path | None:
        if self._base is None:
            layout = detect_layout(self.cgroup_root)
            if layout is not None:
                self._base = layout.cpuset if layout.version == 1 else layout.root
        return self._base

    def read(self, cgroup_path: str) -> frozenset[int] | None:
        """None when the cgroup does not exist (the container is gone) or cannot be read."""
        base = self.base()
        if base is None or not cgroup_path:
            return None
        try:
            text = (base / cgroup_path.lstrip("/") / "cpuset.cpus").read_text()
        except OSError:
            return None
        try:
            return parse_cpulist(text.strip())
        except ValueError:
            return None


def _running(c: Container) -> bool:
    return c.state in (State.RUNNING, State.UNKNOWN)


def check(containers: Iterable[Container], kernel: KernelCpusets) -> tuple[InvariantReport, dict[str, frozenset[int]]]:
    """The violations, and the kernel cpusets read (container id -> CPUs)."""
    ctrs = list(containers)
    report = InvariantReport()
    # 1. the books
    owner: dict[int, str] = {}
    for c in ctrs:
        if c.placement != Kind.EXCLUSIVE or not c.live:
            continue
        for cpu in c.cpu_set:
            if cpu in owner and owner[cpu] != c.id:
                report.violations.append(Violation(Rule.BOOKS_OVERLAP, c.id, f"CPU {cpu} also booked", owner[cpu]))
            owner.setdefault(cpu, c.id)
    # the kernel
    seen: dict[str, frozenset[int]] = {}
    for c in ctrs:
        if _running(c):
            got = kernel.read(c.cgroup_path)
            if got is not None:
                seen[c.id] = got
    report.checked = len(seen)
    excl = [c for c in ctrs if c.placement == Kind.EXCLUSIVE and c.id in seen]
    for c in excl:
        if seen[c.id] != c.cpu_set:
            report.violations.append(Violation(Rule.EXCLUSIVE_MISMATCH, c.id,
                                               f"kernel {format_cpulist(seen[c.id])}, allocated {c.cpus}"))
    kernel_owner: dict[int, str] = {}
    for c in excl:
        for cpu in seen[c.id]:
            if cpu in kernel_owner:
                report.violations.append(Violation(Rule.EXCLUSIVE_OVERLAP, c.id, f"CPU {cpu}", kernel_owner[cpu]))
            kernel_owner.setdefault(cpu, c.id)
    # Only running exclusive containers count: a created one's CPUs are being vacated (it starts once they are).
    exclusive_cpus = {cpu: c.id for c in excl for cpu in c.cpu_set}
    exclusive_cpus.update(kernel_owner)
    for c in ctrs:
        if c.placement == Kind.EXCLUSIVE or c.id not in seen:
            continue
        clash = seen[c.id] & exclusive_cpus.keys()
        if clash:
            other = exclusive_cpus[min(clash)]
            report.violations.append(Violation(Rule.SHARED_ON_EXCLUSIVE, c.id,
                                               f"runs on exclusive CPUs {format_cpulist(frozenset(clash))}", other))
    return report, seen
