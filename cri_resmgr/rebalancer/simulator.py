"""Scenario families on the topology fixtures, and rounds of planning applied to a scenario.

Families (each a function of machine, number of containers and seed; the same arguments give the
same scenario):

- ``avx512-mix``: everyone on the shared pool; a quarter run AVX512 code, some of the rest are
  latency-critical. The plan should fence the AVX512 work off.
- ``bandwidth-hogs``: a few containers that each pull a good part of a NUMA node's bandwidth, all
  pinned to the same node.
- ``cache-thrashers``: containers with working sets near the L3 size packed into one L3 domain.
- ``latency-critical``: latency-critical containers away from SST-BF high-priority cores, batch work
  on them (machines with SST-BF; elsewhere the term is inactive and nothing should move).
- ``fragmented-pools``: small, scattered, overlapping cpusets that oversubscribe some CPUs.
- ``mixed``: all of the above at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import RebalancerConfig
from ..sysfs import format_cpulist
from ..topology import Topology
from ..topology.fixtures import MACHINES, MachineSpec
from .planner import Plan, Planner
from .problem import ANNOTATION_LATENCY_CRITICAL, Problem
from .scenario import Scenario, ScenarioContainer, scenario_cpus_from_spec, topology_from_spec

GB = 1e9


@dataclass
class _Ctx:
    rng: np.random.Generator
    topo: Topology
    spec: MachineSpec
    numa_bw: float

    @property
    def all(self) -> str:
        return format_cpulist(self.topo.cpus)

    def numa(self, n: int) -> str:
        return format_cpulist(c.id for c in self.topo.cpus.values() if c.numa_node == n)

    def l3(self, i: int) -> str:
        return format_cpulist(c.id for c in self.topo.cpus.values() if c.l3_id == i)

    def l3_ids(self) -> list[int]:
        return sorted({c.l3_id for c in self.topo.cpus.values() if c.l3_id is not None})

    def l3_bytes(self) -> float:
        return self.spec.l3_kib_per_domain * 1024.0

    def usage_for(self, n: int, load: float) -> np.ndarray:
        """n usages that add up to ``load`` × CPUs, each at least 0.05."""
        w = self.rng.gamma(2.0, 1.0, n)
        return np.maximum(0.05, w / w.sum() * load * len(self.topo.cpus))


def _c(ctx: _Ctx, i: int, cpuset: str, usage: float, **kw) -> ScenarioContainer:
    qos = kw.pop("qos", ["Burstable", "Burstable", "BestEffort", "Guaranteed"][i % 4])
    request = kw.pop("cpu_request", round(float(usage) * 0.8, 2) if qos != "BestEffort" else 0.0)
    return ScenarioContainer(id=f"c{i:04d}", name=f"c{i:04d}", namespace="sim", pod=f"p{i:04d}", qos=qos,
                             cpu_request=request, cpu_usage=round(float(usage), 3), cpuset=cpuset, **kw)


def avx512_mix(ctx: _Ctx, n: int) -> list[ScenarioContainer]:
    u = ctx.usage_for(n, 0.45)
    out = []
    for i in range(n):
        f = {"avx512_ratio": round(float(ctx.rng.uniform(0.6, 1.0)), 3)} if i % 4 == 0 else {}
        ann = {ANNOTATION_LATENCY_CRITICAL: "true"} if i % 4 == 1 and i % 8 == 1 else {}
        out.append(_c(ctx, i, ctx.all, u[i], features=f, annotations=ann))
    return out


def bandwidth_hogs(ctx: _Ctx, n: int) -> list[ScenarioContainer]:
    """Hogs worth about twice one node's bandwidth, all on node 0; light traffic elsewhere (~20%)."""
    u = ctx.usage_for(n, 0.35)
    nodes = ctx.spec.numa_nodes
    hogs = max(2, min(n // 4, 2 * nodes))
    light = 0.2 * ctx.numa_bw * nodes / max(1, n - hogs)
    out = []
    for i in range(n):
        if i < hogs:
            bw = float(ctx.rng.uniform(0.7, 1.3)) * ctx.numa_bw * 2.0 / hogs
            out.append(_c(ctx, i, ctx.numa(0), min(u[i], 4.0), features={"memory_bandwidth_bytes_per_second": bw,
                                                                         "llc_occupancy_bytes": 4e6}))
        else:
            out.append(_c(ctx, i, ctx.all, u[i], features={"memory_bandwidth_bytes_per_second":
                                                             float(ctx.rng.uniform(0.5, 1.5)) * light}))
    return out


def cache_thrashers(ctx: _Ctx, n: int) -> list[ScenarioContainer]:
    """Working sets worth ~1.5 L3 domains packed into the first; small ones elsewhere."""
    u = ctx.usage_for(n, 0.35)
    domains = ctx.l3_ids()
    thr = max(2, min(n // 4, 3 * len(domains)))
    first = domains[0]
    small = 0.1 * ctx.l3_bytes() * len(domains) / max(1, n - thr)
    out = []
    for i in range(n):
        if i < thr:
            occ = float(ctx.rng.uniform(0.7, 1.3)) * ctx.l3_bytes() * min(1.5, 0.5 * len(domains)) / thr * 2
            out.append(_c(ctx, i, ctx.l3(first), min(u[i], 3.0),
                          features={"llc_occupancy_bytes": occ, "llc_misses_per_second": 2e7}))
        else:
            occ = float(ctx.rng.uniform(0.5, 1.5)) * small
            out.append(_c(ctx, i, ctx.all, u[i], features={"llc_occupancy_bytes": occ}))
    return out


def latency_critical(ctx: _Ctx, n: int) -> list[ScenarioContainer]:
    hp = sorted(c.id for c in ctx.topo.cpus.values() if c.id in ctx.spec.base_frequency_overrides_khz)
    normal = sorted(set(ctx.topo.cpus) - set(hp))
    u = ctx.usage_for(n, 0.3)
    out = []
    for i in range(n):
        if i % 5 == 0:
            out.append(_c(ctx, i, format_cpulist(normal), min(u[i], 2.0), qos="Guaranteed",
                          annotations={ANNOTATION_LATENCY_CRITICAL: "true"}, exclusive=False))
        else:
            out.append(_c(ctx, i, format_cpulist(hp) if hp and i % 5 == 1 else ctx.all, u[i]))
    return out


def fragmented_pools(ctx: _Ctx, n: int) -> list[ScenarioContainer]:
    ids = np.array(sorted(ctx.topo.cpus))
    u = ctx.usage_for(n, 0.55)
    out = []
    for i in range(n):
        k = int(ctx.rng.integers(1, max(2, min(16, len(ids) // 4)) + 1))
        start = int(ctx.rng.integers(0, max(1, len(ids) // 3)))
        cpus = ids[start:start + k] if i % 2 else ctx.rng.choice(ids[: max(k, len(ids) // 2)], size=k, replace=False)
        out.append(_c(ctx, i, format_cpulist(int(x) for x in cpus), min(u[i], float(k)), cpu_request=0.0,
                      features={"memory_bandwidth_bytes_per_second": float(ctx.rng.uniform(0.1, 3.0)) * GB}))
    return out


def mixed(ctx: _Ctx, n: int) -> list[ScenarioContainer]:
    parts = [avx512_mix, bandwidth_hogs, cache_thrashers, latency_critical, fragmented_pools]
    sizes = [n // len(parts) + (1 if i < n % len(parts) else 0) for i in range(len(parts))]
    out: list[ScenarioContainer] = []
    for fam, k in zip(parts, sizes, strict=True):
        for c in fam(ctx, k):
            out.append(c.model_copy(update={"id": f"{fam.__name__}-{c.id}", "name": f"{fam.__name__}-{c.id}"}))
    return out


FAMILIES: dict[str, Callable[[_Ctx, int], list[ScenarioContainer]]] = {
    "avx512-mix": avx512_mix,
    "bandwidth-hogs": bandwidth_hogs,
    "cache-thrashers": cache_thrashers,
    "latency-critical": latency_critical,
    "fragmented-pools": fragmented_pools,
    "mixed": mixed,
}


def generate(family: str, machine: str | MachineSpec = "xeon-2s-112c-snc2", containers: int = 50,
             seed: int = 0, numa_bandwidth_bytes_per_second: float = 60e9, explicit: bool = False,
             rebalancer: dict | None = None) -> Scenario:
    """A scenario of ``family`` on a fixture machine (or any :class:`MachineSpec`; those not in MACHINES,
    or any with ``explicit``, are written as explicit CPUs so the scenario file stands alone)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    spec = MACHINES[machine] if isinstance(machine, str) else machine
    ctx = _Ctx(np.random.default_rng(seed), topology_from_spec(spec), spec, numa_bandwidth_bytes_per_second)
    topo: dict[str, Any]
    if isinstance(machine, str) and not explicit:
        topo = {"fixture": machine}
    else:
        topo = {"cpus": scenario_cpus_from_spec(spec), "l3_size_bytes": spec.l3_kib_per_domain * 1024,
                "numa_distances": {a: {b: spec.distance(a, b) for b in range(spec.numa_nodes)}
                                   for a in range(spec.numa_nodes)}}
    return Scenario.model_validate({
        "name": f"{family} on {spec.name}, {containers} containers, seed {seed}",
        "topology": topo,
        "capacities": {"numa_bandwidth_bytes_per_second": numa_bandwidth_bytes_per_second},
        "containers": [c.model_dump() for c in FAMILIES[family](ctx, containers)],
        "rebalancer": rebalancer or {},
    })


@dataclass
class RoundResult:
    plan: Plan
    scenario: Scenario  # after applying the plan's moves


def apply_plan(sc: Scenario, plan: Plan) -> Scenario:
    """The scenario as it is after every move of ``plan`` was applied (cool-down clock reset)."""
    to = {m.container_id: m.to_cpus for m in plan.moves}
    cs = [c.model_copy(update={"cpuset": to[c.id], "moved_seconds_ago": 0.0}) if c.id in to else c
          for c in sc.containers]
    return sc.model_copy(update={"containers": cs})


def simulate(sc: Scenario, base: RebalancerConfig | None = None, rounds: int = 1) -> list[RoundResult]:
    """Plan, apply, advance the clock by ``interval_seconds`` (ageing cool-downs), repeat."""
    cfg = sc.config(base)
    topo = sc.build_topology()
    node = sc.node_model(cfg, topo)
    planner = Planner(cfg)
    out = []
    for r in range(rounds):
        if r:
            sc = sc.model_copy(update={"containers": [
                c.model_copy(update={"moved_seconds_ago": c.moved_seconds_ago + cfg.interval_seconds})
                if c.moved_seconds_ago is not None else c for c in sc.containers]})
        plan = planner.plan(Problem.build(node, sc.inputs(now=0.0), cfg, now=0.0))
        sc = apply_plan(sc, plan)
        out.append(RoundResult(plan, sc))
    return out
