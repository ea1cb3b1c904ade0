"""Per-container CPU, throttling, memory and cpuset from the cgroup filesystem.

Files (Documentation/admin-guide/cgroup-v2.rst; cgroup-v1/{cpuacct,memory,cpusets}.rst,
Documentation/scheduler/sched-bwc.rst for v1 ``cpu.stat``):

====================  =================================  ==========================================
value                 cgroup v2                          cgroup v1
====================  =================================  ==========================================
CPU usage             cpu.stat ``usage_usec``             cpuacct/cpuacct.usage (ns)
CFS periods           cpu.stat ``nr_periods``             cpu/cpu.stat ``nr_periods``
throttled periods     cpu.stat ``nr_throttled``           cpu/cpu.stat ``nr_throttled``
throttled time        cpu.stat ``throttled_usec``         cpu/cpu.stat ``throttled_time`` (ns)
memory usage          memory.current                     memory/memory.usage_in_bytes
inactive file pages   memory.stat ``inactive_file``       memory/memory.stat ``total_inactive_file``
cpuset                cpuset.cpus.effective              cpuset/cpuset.effective_cpus
====================  =================================  ==========================================

Working set = usage − inactive file, floored at 0: the value the kubelet's eviction manager uses.

On hybrid hosts (v1 controllers plus a v2 tree at ``unified``, as on this machine) the v1 controllers
carry the accounting, so the collector reads v1 there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import metrics as M
from ..config import CgroupCollectorConfig
from ..store import Sample
from ..sysfs import format_cpulist, parse_flat_keyed, read_cpulist, read_int, read_text
from .base import Collector, CollectorUnavailable, Probe
from .identity import ContainerIdentity, is_container_dir, parse_container_path
from .names import RuntimeNames

log = logging.getLogger(__name__)

MAX_DEPTH = 8  # kubepods nesting is at most ~6 deep even under kubelet.slice in kind/minikube


@dataclass(frozen=True)
class CgroupLayout:
    version: int  # 1 or 2
    root: Path  # where containers are discovered (v2 root, or the v1 cpuacct hierarchy)
    cpuacct: Path | None = None
    cpu: Path | None = None
    memory: Path | None = None
    cpuset: Path | None = None
    unified: Path | None = None  # v2 tree on hybrid hosts


def detect_layout(cgroup_root: Path) -> CgroupLayout | None:
    root = Path(cgroup_root)
    if (root / "cgroup.controllers").exists():
        return CgroupLayout(2, root, unified=root)

    def first(*names: str) -> Path | None:
        for n in names:
            if (root / n).is_dir():
                return root / n
        return None

    cpuacct = first("cpuacct", "cpu,cpuacct", "cpuacct,cpu")
    if cpuacct is None:
        return None
    unified = root / "unified" if (root / "unified" / "cgroup.controllers").exists() else None
    return CgroupLayout(
        1, cpuacct, cpuacct=cpuacct, cpu=first("cpu", "cpu,cpuacct", "cpuacct,cpu"),
        memory=first("memory"), cpuset=first("cpuset"), unified=unified,
    )


@dataclass(frozen=True)
class ContainerStats:
    cpu_usage_seconds: float | None = None
    cfs_periods: int | None = None
    cfs_throttled_periods: int | None = None
    cfs_throttled_seconds: float | None = None
    memory_usage_bytes: int | None = None
    memory_working_set_bytes: int | None = None
    cpuset: frozenset[int] | None = None


@dataclass
class ContainerInfo:
    identity: ContainerIdentity
    stats: ContainerStats = field(default_factory=ContainerStats)
    last_seen: float = 0.0


def _stats(usage_seconds: float | None, cpu: dict[str, int], throttled_key: str, throttled_unit: float,
           mem_usage: int | None, inactive: int | None, cpuset: frozenset[int] | None) -> ContainerStats:
    return ContainerStats(
        cpu_usage_seconds=usage_seconds,
        cfs_periods=cpu.get("nr_periods"),
        cfs_throttled_periods=cpu.get("nr_throttled"),
        cfs_throttled_seconds=cpu[throttled_key] / throttled_unit if throttled_key in cpu else None,
        memory_usage_bytes=mem_usage,
        memory_working_set_bytes=(max(0, mem_usage - inactive) if mem_usage is not None and inactive is not None
                                  else mem_usage),
        cpuset=cpuset,
    )


def read_stats(layout: CgroupLayout, rel: str) -> ContainerStats | None:
    """Read one container's files; None when the cgroup has gone (container exited mid-scan).

    Paths are plain strings: this runs for every container every cycle, and pathlib's joins cost more
    than the reads.
    """
    rel = rel.strip("/")
    if layout.version == 2:
        d = f"{layout.root}/{rel}/"
        cpu_text = read_text(d + "cpu.stat")
        if cpu_text is None:
            return None
        cpu = parse_flat_keyed(cpu_text)
        mstat = parse_flat_keyed(read_text(d + "memory.stat") or "")
        usage = cpu.get("usage_usec")
        return _stats(usage / 1e6 if usage is not None else None, cpu, "throttled_usec", 1e6,
                      read_int(d + "memory.current"), mstat.get("inactive_file"),
                      read_cpulist(d + "cpuset.cpus.effective"))
    assert layout.cpuacct is not None
    acct = f"{layout.cpuacct}/{rel}"
    usage_ns = read_int(acct + "/cpuacct.usage")
    if usage_ns is None and not os.path.isdir(acct):
        return None
    cpu = parse_flat_keyed(read_text(f"{layout.cpu}/{rel}/cpu.stat") or "") if layout.cpu else {}
    mem_usage = mstat = None
    if layout.memory:
        mem = f"{layout.memory}/{rel}/"
        mem_usage = read_int(mem + "memory.usage_in_bytes")
        mstat = parse_flat_keyed(read_text(mem + "memory.stat") or "")
    mstat = mstat or {}
    cpuset = None
    if layout.cpuset:
        cs = f"{layout.cpuset}/{rel}/"
        cpuset = read_cpulist(cs + "cpuset.effective_cpus")
        if cpuset is None:
            cpuset = read_cpulist(cs + "cpuset.cpus")
    return _stats(usage_ns / 1e9 if usage_ns is not None else None, cpu, "throttled_time", 1e9, mem_usage,
                  mstat.get("total_inactive_file", mstat.get("inactive_file")), cpuset)


def find_containers(root: Path) -> list[ContainerIdentity]:
    """Walk ``root`` for Kubernetes container cgroups; does not descend into container cgroups."""
    found: list[ContainerIdentity] = []
    root_s = str(root)

    def walk(d: str, depth: int) -> None:
        try:
            it = os.scandir(d)
        except OSError:
            return  # removed while walking, or not readable
        with it:
            for e in it:
                try:
                    if not e.is_dir(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                rel = e.path[len(root_s):]
                if is_container_dir(e.name):
                    ident = parse_container_path(rel)
                    if ident:
                        found.append(ident)
                    continue
                if depth < MAX_DEPTH:
                    walk(e.path, depth + 1)

    walk(root_s, 0)
    return found


def containers_in(paths: Iterable[str]) -> list[ContainerIdentity]:
    """The containers among cgroup paths already listed by another walk (e.g. the cgroup-id scan of the
    eBPF collector), so one tree is not walked twice per cycle."""
    out = []
    for p in paths:
        leaf = p.rsplit("/", 1)[-1]
        if is_container_dir(leaf):
            ident = parse_container_path(p)
            if ident is not None:
                out.append(ident)
    return out


class CgroupCollector(Collector):
    name = "cgroup"

    def __init__(self, cgroup_root: Path, cfg: CgroupCollectorConfig | None = None, names: RuntimeNames | None = None):
        self.cgroup_root = Path(cgroup_root)
        self.cfg = cfg or CgroupCollectorConfig()
        self.containers: dict[str, ContainerInfo] = {}
        self.names = names
        self._version: int | None = None

    def status(self) -> str | None:
        if self.names is not None and self.names.error and self._version:
            return f"cgroup v{self._version}; {self.names.error}"
        return None

    def _named(self, ids: list[ContainerIdentity]) -> list[ContainerIdentity]:
        if self.names is None:
            return ids
        names = self.names.names(i.container_id for i in ids if not i.name)
        out = []
        for i in ids:
            n = names.get(i.container_id)
            if n is not None and not i.name:
                i = replace(i, name=n.container, pod=n.pod, namespace=n.namespace)
            out.append(i)
        return out

    def probe(self) -> Probe:
        layout = detect_layout(self.cgroup_root)
        if layout is None:
            return Probe(False, f"no cgroup hierarchy with CPU accounting under {self.cgroup_root}")
        return Probe(True, f"cgroup v{layout.version}")

    def identities(self, layout: CgroupLayout, found: list[ContainerIdentity] | None = None) -> list[ContainerIdentity]:
        """Containers under ``layout.root`` (walked, unless ``found`` already lists them), named, plus the
        configured extra cgroups."""
        ids = self._named(found if found is not None else find_containers(layout.root))
        for extra in self.cfg.extra_cgroups:
            ids.append(
                ContainerIdentity(
                    container_id=extra.name, pod_uid="", qos_class="", runtime="",
                    cgroup_path="/" + extra.path.strip("/"), name=extra.name,
                    pod=extra.pod, namespace=extra.namespace,
                )
            )
        return ids

    def collect(self, now: float) -> list[Sample]:
        layout = detect_layout(self.cgroup_root)
        if layout is None:
            raise CollectorUnavailable(f"no cgroup hierarchy with CPU accounting under {self.cgroup_root}")
        self._version = layout.version
        samples: list[Sample] = []
        seen: dict[str, ContainerInfo] = {}
        for ident in self.identities(layout):
            st = read_stats(layout, ident.cgroup_path)
            if st is None:
                continue
            seen[ident.container_id] = ContainerInfo(ident, st, now)
            lab = ident.labels()
            for spec, v in (
                (M.CONTAINER_CPU_USAGE, st.cpu_usage_seconds),
                (M.CONTAINER_CPU_PERIODS, st.cfs_periods),
                (M.CONTAINER_CPU_THROTTLED_PERIODS, st.cfs_throttled_periods),
                (M.CONTAINER_CPU_THROTTLED, st.cfs_throttled_seconds),
                (M.CONTAINER_MEMORY_USAGE, st.memory_usage_bytes),
                (M.CONTAINER_MEMORY_WORKING_SET, st.memory_working_set_bytes),
            ):
                if v is not None:
                    samples.append(Sample(spec.name, lab, float(v)))
            if st.cpuset is not None:
                samples.append(
                    Sample(M.CONTAINER_CPUSET_CPUS.name, {**lab, "cpus": format_cpulist(st.cpuset)}, float(len(st.cpuset)))
                )
        self.containers = seen
        return samples
