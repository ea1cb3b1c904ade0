"""Topology-aware choice of exclusive CPUs, and the shared pool that is left.

Exclusive requests (Guaranteed, whole CPUs) are placed by tightest fit in the topology tree:

1. a whole free domain whose size is exactly the request (an L3 domain, NUMA node, die or package,
   smallest kind first) — the container gets that domain and nobody shares its caches or memory controller;
2. else the smallest domain kind that can hold the request, and in it the fitting domain with the fewest
   free CPUs (leaving big holes for big requests); in the domain whole free cores first, then single
   threads, taken from the cores with the fewest free threads (filling holes before breaking cores);
3. else NUMA nodes are combined, fullest-fitting first, nearest (SLIT distance) next.

Hints change the candidate set or the order, never the rules above:

- latency-critical: only SST-BF high-priority cores (``cpufreq/base_frequency`` above the package's lowest,
  see :mod:`cri_resmgr.topology.sst`) when enough are free, else the rest with a note;
- AVX-512: hyperthread siblings are never split between AVX-512 and other exclusive work (the AVX-512
  frequency license is per core: Intel Optimization Reference Manual, "Frequency considerations"), and
  domains already holding work of the same kind are preferred;
- affinity / anti-affinity: domains holding the named containers' CPUs are preferred / avoided.

Memory follows the CPUs: ``mems`` are the NUMA nodes of the chosen CPUs.
Reserved CPUs are never given out exclusively, and at least ``min_shared_cpus`` stay in the shared pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sysfs import format_cpulist
from ..topology import Topology
from ..topology.sst import classify_cpus


class InsufficientCpus(Exception):
    pass


@dataclass(frozen=True)
class Hints:
    latency_critical: bool = False
    avx512: bool = False
    near: frozenset[int] = frozenset()  # CPUs of containers to be close to
    away: frozenset[int] = frozenset()  # CPUs of containers to keep away from
    prefer: frozenset[int] = frozenset()  # CPUs the container holds now (resize keeps them when it can)


@dataclass(frozen=True)
class Placement:
    cpus: frozenset[int]
    mems: frozenset[int]
    reason: str

    @property
    def cpus_text(self) -> str:
        return format_cpulist(self.cpus)

    @property
    def mems_text(self) -> str:
        return format_cpulist(self.mems)


@dataclass(frozen=True)
class Taken:
    """Exclusive CPUs held now, split by kind of work (for AVX-512 separation)."""

    avx512: frozenset[int] = frozenset()
    other: frozenset[int] = frozenset()

    @property
    def all(self) -> frozenset[int]:
        return self.avx512 | self.other


@dataclass
class _Domain:
    kind: str
    id: str
    cpus: frozenset[int]


@dataclass
class CpuAllocator:
    topology: Topology
    reserved: frozenset[int] = frozenset()
    min_shared_cpus: int = 1
    domains: list[list[_Domain]] = field(init=False)
    high_priority: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        t = self.topology
        online = frozenset(t.cpus)
        unknown = self.reserved - online
        if unknown:
            raise ValueError(f"reserved_cpus {format_cpulist(unknown)} are not online CPUs "
                             f"(online: {format_cpulist(online)})")
        self.online = online
        self.allocatable = online - self.reserved
        # isolcpus CPUs are for explicit use only: exclusive placement may hand them out, the pool never has them.
        self.shared_base = online - self.reserved - t.isolated
        self.core_of = {c.id: c.core for c in t.cpus.values()}
        self.threads = {core: cpus for core, cpus in t.cores().items()}
        # Kinds that partition the CPUs identically keep the first name: die before l3 on one-L3-per-die parts.
        kinds: dict[str, dict[str, set[int]]] = {"numa": {}, "die": {}, "package": {}, "l3": {}}
        for c in t.cpus.values():
            kinds["numa"].setdefault(str(c.numa_node), set()).add(c.id)
            kinds["die"].setdefault(f"{c.package}/{c.die}", set()).add(c.id)
            kinds["package"].setdefault(str(c.package), set()).add(c.id)
            if c.l3_id is not None:
                kinds["l3"].setdefault(f"{c.package}/{c.l3_id}", set()).add(c.id)
        levels: list[list[_Domain]] = []
        seen: set[frozenset[frozenset[int]]] = set()
        for kind, doms in kinds.items():
            part = frozenset(frozenset(v) for v in doms.values())
            if not doms or part in seen:
                continue  # a kind that partitions the CPUs exactly like an earlier one adds nothing
            seen.add(part)
            levels.append([_Domain(kind, k, frozenset(v)) for k, v in sorted(doms.items())])
        levels.sort(key=lambda lv: sum(len(d.cpus) for d in lv) / len(lv))
        self.domains = levels
        self.high_priority = classify_cpus(t.cpus.values()).high_priority

    # -- pools --------------------------------------------------------------------------------------
    def shared_pool(self, taken: frozenset[int]) -> frozenset[int]:
        return self.shared_base - taken

    def mems_of(self, cpus: frozenset[int]) -> frozenset[int]:
        return frozenset(self.topology.cpus[c].numa_node for c in cpus if c in self.topology.cpus)

    def shared_placement(self, taken: frozenset[int]) -> Placement:
        pool = self.shared_pool(taken)
        return Placement(pool, self.mems_of(pool), "shared pool")

    def reserved_placement(self, taken: frozenset[int]) -> Placement:
        if not self.reserved:
            return self.shared_placement(taken)
        return Placement(self.reserved, self.mems_of(self.reserved), "reserved CPUs")

    # -- exclusive ----------------------------------------------------------------------------------
    def allocate(self, n: int, taken: Taken, hints: Hints = Hints()) -> Placement:
        if n <= 0:
            raise ValueError(f"exclusive request must be at least one CPU, got {n}")
        free = self.allocatable - taken.all
        notes: list[str] = []
        if len(free) < n or len(self.shared_base - taken.all) - self.min_shared_cpus < n - len(free - self.shared_base):
            raise InsufficientCpus(
                f"insufficient CPUs: {n} exclusive requested, {len(free)} free ({format_cpulist(free) or 'none'}) "
                f"and the shared pool must keep {self.min_shared_cpus}")
        pool = free
        if hints.latency_critical:
            if not self.high_priority:
                notes.append("latency-critical: no SST-BF high-priority cores on this node")
            elif len(free & self.high_priority) >= n:
                pool = free & self.high_priority
                notes.append("latency-critical: SST-BF high-priority cores")
            else:
                notes.append(f"latency-critical: only {len(free & self.high_priority)} SST-BF high-priority "
                             f"CPUs free, using others")
        if hints.prefer and hints.prefer <= free and len(hints.prefer) == n:
            chosen, why = hints.prefer, "kept its CPUs"
        else:
            chosen, why = self._choose(n, pool, taken, hints)
        if len(self.shared_base - taken.all - chosen) < self.min_shared_cpus:
            raise InsufficientCpus(f"{n} exclusive CPUs would leave fewer than {self.min_shared_cpus} CPUs "
                                   f"in the shared pool")
        return Placement(chosen, self.mems_of(chosen), "; ".join([why, *notes]))

    def _score(self, d: _Domain, pool: frozenset[int], taken: Taken, hints: Hints) -> tuple:
        same = taken.avx512 if hints.avx512 else taken.other
        other = taken.other if hints.avx512 else taken.avx512
        return (
            bool(d.cpus & hints.away),  # anti-affinity first: avoid
            not (d.cpus & hints.near) if hints.near else False,  # affinity: prefer
            bool(d.cpus & other) and not (d.cpus & same),  # keep AVX-512 and other work in separate domains
            len(d.cpus & pool),  # tightest fit
            min(d.cpus),
        )

    def _choose(self, n: int, pool: frozenset[int], taken: Taken, hints: Hints) -> tuple[frozenset[int], str]:
        # 1. a whole free domain of exactly the request
        for level in self.domains:
            exact = [d for d in level if len(d.cpus) == n and d.cpus <= pool]
            if exact:
                d = min(exact, key=lambda d: self._score(d, pool, taken, hints))
                return d.cpus, f"whole {d.kind} {d.id}"
        # 2. the smallest kind of domain that can hold it, tightest domain first
        for level in self.domains:
            picks = {id(d): self._pick(n, d.cpus & pool, taken, hints) for d in level if len(d.cpus & pool) >= n}
            fits = [d for d in level if picks.get(id(d)) is not None]
            if fits:
                d = min(fits, key=lambda d: self._score(d, pool, taken, hints))
                best = picks[id(d)]
                assert best is not None
                return best, f"{n} CPUs within {d.kind} {d.id}"
        # 3. several NUMA nodes, nearest to the fullest first
        nodes = self.topology.numa_nodes
        numa = next((lv for lv in self.domains if lv[0].kind == "numa"), None) or \
            [_Domain("numa", str(k), v.cpus) for k, v in nodes.items()]
        order = sorted(numa, key=lambda d: (-len(d.cpus & pool), min(d.cpus)))
        first = int(order[0].id)
        order = [order[0]] + sorted(order[1:], key=lambda d: (
            nodes[first].distances.get(int(d.id), 100) if first in nodes else 0, -len(d.cpus & pool), min(d.cpus)))
        chosen: set[int] = set()
        used = []
        for d in order:
            avail = (d.cpus & pool) - chosen
            if not avail:
                continue
            k = min(n - len(chosen), len(avail))
            part = self._pick(k, frozenset(avail), taken, hints)
            if part is None:
                part = frozenset(sorted(avail)[:k])
            chosen |= part
            used.append(d.id)
            if len(chosen) == n:
                return frozenset(chosen), f"{n} CPUs across NUMA nodes {','.join(used)}"
        raise InsufficientCpus(f"insufficient CPUs: {n} exclusive requested, {len(pool)} eligible")

    def _pick(self, n: int, avail: frozenset[int], taken: Taken, hints: Hints) -> frozenset[int] | None:
        """n CPUs out of ``avail``: whole free cores first, then threads of the fullest cores."""
        conflict = taken.other if hints.avx512 else taken.avx512
        whole: list[tuple[int, frozenset[int]]] = []
        partial: list[tuple[int, frozenset[int]]] = []
        for core in sorted({self.core_of[c] for c in avail}):
            threads = self.threads[core]
            free_here = threads & avail
            if free_here == threads:
                whole.append((core, threads))
            elif not (threads & conflict):
                partial.append((core, free_here))
        chosen: set[int] = set()
        # prefer cores near affine containers' CPUs by taking cores in order; the domain choice did the rest
        for _core, threads in whole:
            if len(chosen) + len(threads) > n:
                break
            chosen |= threads
        if len(chosen) == n:
            return frozenset(chosen)
        need = n - len(chosen)
        # fill holes: threads of partly used cores, fullest first
        for _core, threads in sorted(partial, key=lambda ct: (len(ct[1]), ct[0])):
            for c in sorted(threads):
                if need == 0:
                    break
                chosen.add(c)
                need -= 1
        # then break whole cores not used yet
        for _core, threads in whole:
            if need == 0:
                break
            if threads & chosen:
                continue
            for c in sorted(threads)[:need]:
                chosen.add(c)
                need -= 1
        return frozenset(chosen) if need == 0 else None
