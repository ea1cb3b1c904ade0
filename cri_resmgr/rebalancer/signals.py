"""Model input from the store's recent window.

Series read (averages or rates over ``rebalancer.window_seconds``):

==========================  ==========================================================  ==========
input                       series                                                      source
==========================  ==========================================================  ==========
containers, labels          ``cri_resmgr_container_cpuset_cpus`` (newest per id)        cgroup
cpuset                      the cgroup collector's last reading (``cpusets``; not in    cgroup
                            the store: a label listing CPUs would churn series)
CPU usage                   rate of ``cri_resmgr_container_cpu_usage_seconds_total``     cgroup
AVX512 ratio                ``cri_resmgr_container_avx512_ratio``, else the rate ratio   avx512
                            of ``..._avx512_switches_total`` / ``..._context_switches_total``
LLC misses/s                rate of ``cri_resmgr_container_llc_misses_total``            perf
memory bandwidth            rate of ``cri_resmgr_container_memory_bandwidth_bytes_total  rdt (MBM)
                            {scope="total"}``, summed over ``cache_id``
cache occupancy             ``cri_resmgr_container_llc_occupancy_bytes``, summed over    rdt (CMT)
                            ``cache_id``
SST-BF priority             ``cri_resmgr_cpu_sst_bf_high_priority{cpu}`` (else the       sst
                            topology's ``base_frequency``)
==========================  ==========================================================  ==========

A signal with no series at all is *missing*: it counts as zero and the plan lists it, naming the
collector that provides it. Where that collector cannot run, ``rebalancer.overrides`` (config) can set
the same values for containers matched by their labels — which is how the end-to-end test marks its
AVX512 cgroups. Requests, annotations and exclusivity come from a :class:`MetadataSource` (the relay's
container cache) when there is one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from .. import metrics as M
from ..config import RebalancerConfig
from ..store import Matcher, Store
from ..store.query import window_by_label
from .problem import ANNOTATION_LATENCY_CRITICAL, ContainerInput

CPUSET = M.CONTAINER_CPUSET_CPUS.name
USAGE = M.CONTAINER_CPU_USAGE.name
# Defined by the collectors of issues #3 and #4 (names as those issues specify them).
AVX512_RATIO = "cri_resmgr_container_avx512_ratio"
AVX512_SWITCHES = "cri_resmgr_container_avx512_switches_total"
CONTEXT_SWITCHES = "cri_resmgr_container_context_switches_total"
LLC_MISSES = "cri_resmgr_container_llc_misses_total"
MEMORY_BANDWIDTH = "cri_resmgr_container_memory_bandwidth_bytes_total"
LLC_OCCUPANCY = "cri_resmgr_container_llc_occupancy_bytes"
SST_BF_HIGH_PRIORITY = "cri_resmgr_cpu_sst_bf_high_priority"


@dataclass(frozen=True)
class ContainerMetadata:
    """What the relay knows and the cgroup tree does not."""

    cpu_request: float | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)
    qos: str | None = None
    exclusive: bool | None = None


class MetadataSource(Protocol):
    def metadata(self) -> Mapping[str, ContainerMetadata]:
        """Container id -> metadata."""


CpusetSource = Callable[[], Mapping[str, frozenset[int]]]
"""Container id -> effective cpuset, e.g. :meth:`CgroupCollector.cpusets`."""


@dataclass
class Inputs:
    containers: list[ContainerInput]
    missing: list[str]
    high_priority_cpus: frozenset[int] | None  # from the store; None: use the topology's


def _per_container(store: Store, metric: str, now: float, window: float, fn: str,
                   matchers: list[Matcher] | None = None) -> dict[str, float]:
    """container_id -> the window's value, summed over series of one container (e.g. per cache_id)."""
    return window_by_label(store, metric, matchers or [], now, window, fn, "container_id")


def _matches(match: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


def read_inputs(store: Store, cfg: RebalancerConfig, now: float, last_moved: Mapping[str, float] | None = None,
                metadata: Mapping[str, ContainerMetadata] | None = None, only_known: bool = False,
                cpusets: Mapping[str, frozenset[int]] | None = None) -> Inputs:
    """``cpusets``: container id -> effective cpuset (the cgroup collector's last reading); a container
    of the store without one is left out (it has gone, or no source was given).
    ``only_known``: the metadata is the relay's cache and the relay applies the moves, so containers it
    does not know (other runtimes' containers, extra cgroups) still count in the cost but are not moved:
    the relay would refuse them."""
    window = cfg.window_seconds
    # Newest cpuset series per container (its labels name the container; the CPUs come from ``cpusets``).
    newest: dict[str, tuple[float, dict[str, str]]] = {}
    for ref, t, _v in store.latest(CPUSET, max_age_rows=2):
        lab = ref.label_dict
        cid = lab.get("container_id")
        if cid and (cid not in newest or t > newest[cid][0]):
            newest[cid] = (t, lab)
    usage = _per_container(store, USAGE, now, window, "rate")
    missing: list[str] = []

    avx = _per_container(store, AVX512_RATIO, now, window, "raw")
    if not avx:
        sw, cs = (_per_container(store, m, now, window, "rate") for m in (AVX512_SWITCHES, CONTEXT_SWITCHES))
        avx = {k: sw.get(k, 0.0) / v for k, v in cs.items() if v > 0}
        if not cs:
            missing.append(f"avx512_ratio (no {AVX512_RATIO} or {CONTEXT_SWITCHES} series: "
                           "the avx512 collector, collectors.avx512)")
    misses = _per_container(store, LLC_MISSES, now, window, "rate")
    if not store.has_metric(LLC_MISSES):
        missing.append(f"llc_misses_per_second (no {LLC_MISSES}: the perf collector, collectors.perf)")
    bw = _per_container(store, MEMORY_BANDWIDTH, now, window, "rate", [Matcher("scope", "=", "total")])
    if not store.has_metric(MEMORY_BANDWIDTH):
        missing.append(f"memory_bandwidth (no {MEMORY_BANDWIDTH}: RDT MBM, collectors.rdt; LLC misses × 64 B used)")
    occ = _per_container(store, LLC_OCCUPANCY, now, window, "raw")
    if not store.has_metric(LLC_OCCUPANCY):
        missing.append(f"llc_occupancy (no {LLC_OCCUPANCY}: RDT CMT, collectors.rdt)")
    hp = None
    sst = store.latest(SST_BF_HIGH_PRIORITY, max_age_rows=2)
    if sst:
        hp = frozenset(int(r.label_dict["cpu"]) for r, _t, v in sst
                       if v >= 0.5 and r.label_dict.get("cpu", "").isdigit())

    metadata = metadata or {}
    out = []
    used_overrides = 0
    for cid, (_t, lab) in sorted(newest.items()):
        cpus = (cpusets or {}).get(cid)
        if cpus is None:
            continue
        md = metadata.get(cid, ContainerMetadata())
        c = ContainerInput(
            id=cid, cpuset=cpus, cpu_usage=max(0.0, usage.get(cid, 0.0)),
            cpu_request=md.cpu_request or 0.0, qos=md.qos or lab.get("qos_class", ""),
            name=lab.get("container", ""), namespace=lab.get("namespace", ""), pod=lab.get("pod", ""),
            avx512_ratio=min(1.0, max(0.0, avx.get(cid, 0.0))),
            llc_misses_per_second=max(0.0, misses[cid]) if cid in misses else None,
            memory_bandwidth_bytes_per_second=bw.get(cid) if bw else None,
            llc_occupancy_bytes=max(0.0, occ[cid]) if cid in occ else None,
            annotations=dict(md.annotations), exclusive=md.exclusive,
            last_moved=(last_moved or {}).get(cid),
            pinned_reason="not known to the relay" if only_known and cid not in metadata else None,
        )
        for o in cfg.overrides:
            if not _matches(o.match, lab):
                continue
            used_overrides += 1
            upd = {k: getattr(o, k) for k in ("avx512_ratio", "cpu_request", "exclusive", "llc_occupancy_bytes",
                                              "llc_misses_per_second", "memory_bandwidth_bytes_per_second")
                   if getattr(o, k) is not None}
            if o.latency_critical is not None:
                upd["annotations"] = {**c.annotations, ANNOTATION_LATENCY_CRITICAL: str(o.latency_critical).lower()}
            c = replace(c, **upd)
        out.append(c)
    if used_overrides:
        missing = [m + " — rebalancer.overrides set values" if m.startswith(("avx512", "llc", "memory")) else m
                   for m in missing]
    return Inputs(out, missing, hp)
