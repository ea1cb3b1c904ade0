"""Readable tree of a :class:`Topology` for ``cri-resmgr topology``."""

from __future__ import annotations

from ..sysfs import format_cpulist
from .discover import Cache, Topology


def _size(n: int) -> str:
    for unit, div in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _freq(hz: int | None) -> str:
    return f" base {hz / 1e9:.2f} GHz" if hz else ""


def render_tree(t: Topology) -> str:
    lines = [
        f"machine: {len(t.packages)} package(s), {len(t.numa_nodes)} NUMA node(s), "
        f"{len(t.cores())} core(s), {len(t.cpus)} online CPU(s)",
        f"  online {format_cpulist(t.online) or '-'}  offline {format_cpulist(t.offline) or '-'}  "
        f"isolated {format_cpulist(t.isolated) or '-'}",
    ]
    for nid, n in sorted(t.numa_nodes.items()):
        dist = " ".join(f"{k}:{v}" for k, v in sorted(n.distances.items()))
        lines.append(f"  numa node {nid}: cpus {format_cpulist(n.cpus) or '-'}  distances {dist}")
    l3s = t.caches_at(3)
    l2_by_id = {c.id: c for c in t.caches_at(2)}
    for p in t.packages:
        lines.append(f"package {p}")
        for d in t.dies(p):
            lines.append(f"  die {d}")
            die_cpus = {c.id for c in t.cpus.values() if c.package == p and c.die == d}
            groups: list[Cache | None] = [c for c in l3s if c.cpus & die_cpus] or [None]
            for l3 in groups:
                ind = "    "
                if l3 is not None:
                    lines.append(f"    L3 #{l3.id} {_size(l3.size_bytes)} cpus {format_cpulist(l3.cpus)}")
                    ind = "      "
                cores = sorted(
                    {c.core for c in t.cpus.values() if c.id in die_cpus and (l3 is None or c.id in l3.cpus)}
                )
                for core in cores:
                    threads = sorted((c for c in t.cpus.values() if c.core == core), key=lambda c: c.id)
                    first = threads[0]
                    l2 = l2_by_id.get(first.l2_id) if first.l2_id is not None else None
                    l2s = f" L2 {_size(l2.size_bytes)}" if l2 else ""
                    lines.append(f"{ind}core {first.core_id} (numa {first.numa_node}){l2s}")
                    for c in threads:
                        flags = " isolated" if c.isolated else ""
                        lines.append(f"{ind}  cpu {c.id}{_freq(c.base_frequency_hz)}{flags}")
    return "\n".join(lines)
