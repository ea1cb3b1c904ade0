"""Build fake sysfs trees that follow the kernel's layout, from a machine spec.

Used by tests (discovery is compared against the spec that built the tree) and by demos
(``cri-resmgr fixture sysfs --machine NAME DIR``). The layout mirrors what
``drivers/base/topology.c``, ``drivers/base/cacheinfo.c`` and ``drivers/base/node.c`` create.

CPU numbering follows what Linux does on Intel servers: first the first hardware thread of every
core, package by package, then the second threads in the same order (so cpu0 and cpuN/2 are siblings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..sysfs import format_cpulist


@dataclass(frozen=True)
class MachineSpec:
    name: str
    packages: int
    dies_per_package: int
    cores_per_die: int
    threads_per_core: int
    numa_per_package: int  # >1 models sub-NUMA clustering (SNC)
    l3_per_die: int  # >1 models AMD EPYC's several CCX/CCD L3 domains per socket
    l1d_kib: int = 48
    l1i_kib: int = 32
    l2_kib: int = 2048
    l3_kib_per_domain: int = 32768
    base_frequency_khz: int | None = None
    # cpu -> base frequency override (SST-BF high-priority cores have a higher base frequency)
    base_frequency_overrides_khz: dict[int, int] = field(default_factory=dict)
    offline: frozenset[int] = frozenset()
    isolated: frozenset[int] = frozenset()

    @property
    def cores(self) -> int:
        return self.packages * self.dies_per_package * self.cores_per_die

    @property
    def cpus(self) -> int:
        return self.cores * self.threads_per_core

    @property
    def numa_nodes(self) -> int:
        return self.packages * self.numa_per_package

    def layout(self) -> list[dict]:
        """One record per CPU: the truth a discovery run must reproduce."""
        out = []
        cores_per_pkg = self.dies_per_package * self.cores_per_die
        cores_per_numa = cores_per_pkg // self.numa_per_package
        cores_per_l3 = self.cores_per_die // self.l3_per_die
        for t in range(self.threads_per_core):
            for g in range(self.cores):  # g: global core index
                cpu = t * self.cores + g
                pkg, in_pkg = divmod(g, cores_per_pkg)
                die, in_die = divmod(in_pkg, self.cores_per_die)
                numa = pkg * self.numa_per_package + in_pkg // cores_per_numa
                l3 = (pkg * self.dies_per_package + die) * self.l3_per_die + in_die // cores_per_l3
                out.append(
                    dict(
                        cpu=cpu,
                        package=pkg,
                        die=die,
                        core_id=in_pkg,
                        global_core=g,
                        numa_node=numa,
                        l2_id=g,
                        l3_id=l3,
                        siblings=[tt * self.cores + g for tt in range(self.threads_per_core)],
                    )
                )
        return sorted(out, key=lambda r: r["cpu"])

    def distance(self, a: int, b: int) -> int:
        # ACPI SLIT values as firmware typically reports them: 10 local, 12 same socket (SNC), 21 remote.
        if a == b:
            return 10
        if a // self.numa_per_package == b // self.numa_per_package:
            return 12
        return 21


MACHINES: dict[str, MachineSpec] = {
    # This development/CI VM: one package, two cores without SMT, one shared 32 MiB L3.
    "this-vm": MachineSpec(
        "this-vm", packages=1, dies_per_package=1, cores_per_die=2, threads_per_core=1,
        numa_per_package=1, l3_per_die=1, l2_kib=1024, l3_kib_per_domain=32768,
    ),
    # 2-socket Xeon, 56 cores per socket (112 cores, 224 threads), SNC2: two NUMA nodes per socket,
    # with SST-BF: the first 8 cores of each package run at a higher base frequency.
    "xeon-2s-112c-snc2": MachineSpec(
        "xeon-2s-112c-snc2", packages=2, dies_per_package=1, cores_per_die=56, threads_per_core=2,
        numa_per_package=2, l3_per_die=1, l2_kib=2048, l3_kib_per_domain=107520,
        base_frequency_khz=2000000,
        base_frequency_overrides_khz={
            c: 2600000 for p in range(2) for t in range(2) for c in
            [t * 112 + p * 56 + i for i in range(8)]
        },
    ),
    # 1-socket EPYC-like: 64 cores in 8 CCDs of 8 cores, each CCD its own 32 MiB L3, SMT2.
    "epyc-1s-64c-8l3": MachineSpec(
        "epyc-1s-64c-8l3", packages=1, dies_per_package=1, cores_per_die=64, threads_per_core=2,
        numa_per_package=1, l3_per_die=8, l1d_kib=32, l2_kib=1024, l3_kib_per_domain=32768,
    ),
    # Small machine with an offline and an isolated CPU, for hotplug/isolcpus handling.
    "small-offline-isolated": MachineSpec(
        "small-offline-isolated", packages=1, dies_per_package=1, cores_per_die=4, threads_per_core=2,
        numa_per_package=1, l3_per_die=1, offline=frozenset({7}), isolated=frozenset({3}),
    ),
}


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def build_sysfs(spec: MachineSpec, root: Path) -> Path:
    """Write a sysfs tree for ``spec`` under ``root`` and return ``root``."""
    root = Path(root)
    cpu_dir = root / "devices/system/cpu"
    node_dir = root / "devices/system/node"
    layout = spec.layout()
    all_cpus = [r["cpu"] for r in layout]
    online = [c for c in all_cpus if c not in spec.offline]
    _w(cpu_dir / "present", format_cpulist(all_cpus))
    _w(cpu_dir / "possible", format_cpulist(all_cpus))
    _w(cpu_dir / "online", format_cpulist(online))
    _w(cpu_dir / "offline", format_cpulist(spec.offline))
    _w(cpu_dir / "isolated", format_cpulist(spec.isolated))
    for r in layout:
        c = r["cpu"]
        base = cpu_dir / f"cpu{c}"
        if c != 0:
            _w(base / "online", "0" if c in spec.offline else "1")
        if c in spec.offline:
            base.mkdir(parents=True, exist_ok=True)
            continue
        sib = [s for s in r["siblings"] if s not in spec.offline]
        top = base / "topology"
        _w(top / "physical_package_id", str(r["package"]))
        _w(top / "die_id", str(r["die"]))
        _w(top / "core_id", str(r["core_id"]))
        _w(top / "thread_siblings_list", format_cpulist(sib))
        _w(top / "core_cpus_list", format_cpulist(sib))
        pkg_cpus = [x["cpu"] for x in layout if x["package"] == r["package"] and x["cpu"] not in spec.offline]
        _w(top / "package_cpus_list", format_cpulist(pkg_cpus))
        _w(top / "core_siblings_list", format_cpulist(pkg_cpus))
        die_cpus = [x["cpu"] for x in layout if (x["package"], x["die"]) == (r["package"], r["die"])
                    and x["cpu"] not in spec.offline]
        _w(top / "die_cpus_list", format_cpulist(die_cpus))
        l3_cpus = [x["cpu"] for x in layout if x["l3_id"] == r["l3_id"] and x["cpu"] not in spec.offline]
        for idx, (level, ctype, kib, cid, shared) in enumerate(
            [
                (1, "Data", spec.l1d_kib, r["global_core"], sib),
                (1, "Instruction", spec.l1i_kib, r["global_core"], sib),
                (2, "Unified", spec.l2_kib, r["l2_id"], sib),
                (3, "Unified", spec.l3_kib_per_domain, r["l3_id"], l3_cpus),
            ]
        ):
            d = base / f"cache/index{idx}"
            _w(d / "level", str(level))
            _w(d / "type", ctype)
            _w(d / "size", f"{kib}K")
            _w(d / "id", str(cid))
            _w(d / "shared_cpu_list", format_cpulist(shared))
        khz = spec.base_frequency_overrides_khz.get(c, spec.base_frequency_khz)
        if khz:
            _w(base / "cpufreq/base_frequency", str(khz))
    nodes = list(range(spec.numa_nodes))
    _w(node_dir / "online", format_cpulist(nodes))
    _w(node_dir / "possible", format_cpulist(nodes))
    for n in nodes:
        cpus = [r["cpu"] for r in layout if r["numa_node"] == n and r["cpu"] not in spec.offline]
        _w(node_dir / f"node{n}/cpulist", format_cpulist(cpus))
        _w(node_dir / f"node{n}/distance", " ".join(str(spec.distance(n, m)) for m in nodes))
    return root
