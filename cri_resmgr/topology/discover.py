"""CPU and memory topology from sysfs.

Sources (all under ``paths.sysfs``):
- ``devices/system/cpu/{online,offline,present,isolated}`` and ``cpuN/topology/*``
  (Documentation/admin-guide/cputopology.rst, Documentation/ABI/stable/sysfs-devices-system-cpu);
- ``cpuN/cache/indexK/{level,type,size,id,shared_cpu_list}``
  (Documentation/ABI/testing/sysfs-devices-system-cpu, "cache");
- ``devices/system/node/nodeN/{cpulist,distance}`` (Documentation/ABI/stable/sysfs-devices-node);
- ``cpuN/cpufreq/base_frequency`` in kHz, present with intel_pstate on SST-BF capable parts
  (Documentation/admin-guide/pm/intel-speed-select.rst).

Offline CPUs keep only ``cpuN/online``: the kernel removes their topology and cache directories on hot-unplug.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ..sysfs import parse_size, read_cpulist, read_int, read_text
from .sst import classify_cpus as sst_classify_cpus


@dataclass(frozen=True)
class Cache:
    level: int
    type: str  # Data, Instruction, Unified
    size_bytes: int
    id: int
    cpus: frozenset[int]


@dataclass(frozen=True)
class Cpu:
    id: int
    package: int
    die: int
    core_id: int  # as the kernel reports it: unique within a package only
    core: int  # node-unique core number: the lowest CPU id among the core's threads
    numa_node: int
    l2_id: int | None
    l3_id: int | None
    isolated: bool
    base_frequency_hz: int | None
    sst_bf_priority: str = ""  # "high" | "low" on SST-BF packages (topology/sst.py), else ""

    def labels(self) -> dict[str, str]:
        return {
            "cpu": str(self.id),
            "core": str(self.core),
            "die": str(self.die),
            "numa_node": str(self.numa_node),
            "package": str(self.package),
        }


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: frozenset[int]
    distances: dict[int, int]


@dataclass
class Topology:
    cpus: dict[int, Cpu] = field(default_factory=dict)  # online CPUs only
    numa_nodes: dict[int, NumaNode] = field(default_factory=dict)
    caches: list[Cache] = field(default_factory=list)  # unique cache domains
    present: frozenset[int] = frozenset()
    online: frozenset[int] = frozenset()
    offline: frozenset[int] = frozenset()
    isolated: frozenset[int] = frozenset()

    @property
    def packages(self) -> list[int]:
        return sorted({c.package for c in self.cpus.values()})

    def dies(self, package: int) -> list[int]:
        return sorted({c.die for c in self.cpus.values() if c.package == package})

    def cores(self) -> dict[int, frozenset[int]]:
        out: dict[int, set[int]] = {}
        for c in self.cpus.values():
            out.setdefault(c.core, set()).add(c.id)
        return {k: frozenset(v) for k, v in sorted(out.items())}

    def caches_at(self, level: int) -> list[Cache]:
        return [c for c in self.caches if c.level == level and c.type in ("Unified", "Data")]

    def cpu_labels(self, cpu: int) -> dict[str, str]:
        c = self.cpus.get(cpu)
        if c is None:
            return {"cpu": str(cpu), "core": "", "die": "", "numa_node": "", "package": ""}
        return c.labels()


def _cpu_ids(cpu_dir: Path) -> list[int]:
    ids = []
    for p in cpu_dir.glob("cpu[0-9]*"):
        try:
            ids.append(int(p.name[3:]))
        except ValueError:
            continue
    return sorted(ids)


def discover(sysfs: Path) -> Topology:
    """Read the topology under ``sysfs`` (normally ``/sys``). Missing files degrade, never raise."""
    cpu_dir = Path(sysfs) / "devices/system/cpu"
    node_dir = Path(sysfs) / "devices/system/node"

    cpulist = read_cpulist
    all_ids = frozenset(_cpu_ids(cpu_dir))
    present = cpulist(cpu_dir / "present") or all_ids
    online = cpulist(cpu_dir / "online")
    if online is None:
        # Without the summary file, a CPU is online unless its own "online" file says 0
        # (cpu0 often has no such file because it cannot be unplugged).
        online = frozenset(i for i in all_ids if read_int(cpu_dir / f"cpu{i}/online", 1) == 1)
    offline = cpulist(cpu_dir / "offline") or frozenset(present - online)
    isolated = cpulist(cpu_dir / "isolated") or frozenset()

    numa: dict[int, NumaNode] = {}
    cpu_node: dict[int, int] = {}
    if node_dir.is_dir():
        for p in sorted(node_dir.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            nid = int(p.name[4:])
            node_cpus = cpulist(p / "cpulist") or frozenset()
            dist_text = read_text(p / "distance") or ""
            try:
                dists = [int(x) for x in dist_text.split()]
            except ValueError:
                dists = []
            numa[nid] = NumaNode(nid, node_cpus, {i: d for i, d in enumerate(dists)})
            for c in node_cpus:
                cpu_node[c] = nid
        # The distance file lists one value per *possible* node, in node order; map by position
        # to the node ids actually present (ids can have gaps on some firmware).
        ids = sorted(numa)
        for nid, n in numa.items():
            if len(n.distances) == len(ids):
                numa[nid] = NumaNode(nid, n.cpus, {ids[i]: d for i, d in n.distances.items()})

    caches: dict[tuple[int, str, int, frozenset[int]], Cache] = {}
    raw: dict[int, dict] = {}
    for cid in sorted(online):
        base = cpu_dir / f"cpu{cid}"
        top = base / "topology"
        package = read_int(top / "physical_package_id", 0)
        die = read_int(top / "die_id", 0)
        core_id = read_int(top / "core_id", cid)
        siblings = cpulist(top / "thread_siblings_list") or cpulist(top / "core_cpus_list") or frozenset({cid})
        l2_id = l3_id = None
        for idx in sorted(base.glob("cache/index[0-9]*")):
            level = read_int(idx / "level")
            ctype = (read_text(idx / "type") or "").strip()
            size_t = read_text(idx / "size")
            shared = cpulist(idx / "shared_cpu_list") or frozenset({cid})
            if level is None or not ctype or size_t is None:
                continue
            try:
                size = parse_size(size_t)
            except ValueError:
                continue
            # Some kernels/VMs lack cache "id"; fall back to the lowest sharing CPU, which is unique per domain.
            cache_id = read_int(idx / "id", min(shared))
            key = (level, ctype, cache_id, shared)
            caches.setdefault(key, Cache(level, ctype, size, cache_id, shared))
            if ctype in ("Unified", "Data"):
                if level == 2:
                    l2_id = cache_id
                elif level == 3:
                    l3_id = cache_id
        khz = read_int(base / "cpufreq/base_frequency")
        raw[cid] = dict(
            package=package,
            die=die,
            core_id=core_id,
            core=min(siblings & online) if siblings & online else cid,
            l2_id=l2_id,
            l3_id=l3_id,
            base_frequency_hz=khz * 1000 if khz else None,
        )

    cpus = {
        cid: Cpu(
            id=cid,
            numa_node=cpu_node.get(cid, 0),
            isolated=cid in isolated,
            **r,
        )
        for cid, r in raw.items()
    }
    bf = sst_classify_cpus(cpus.values())
    if bf.enabled:
        cpus = {cid: replace(c, sst_bf_priority=bf.priority.get(cid, "")) for cid, c in cpus.items()}
    if not numa and cpus:
        numa[0] = NumaNode(0, frozenset(cpus), {0: 10})
    return Topology(
        cpus=cpus,
        numa_nodes=numa,
        caches=sorted(caches.values(), key=lambda c: (c.level, c.type, c.id, min(c.cpus))),
        present=frozenset(present),
        online=frozenset(online),
        offline=frozenset(offline),
        isolated=frozenset(isolated),
    )
