"""Metric names and metadata, built in one place.

Names follow ``cri_resmgr_<subsystem>_<name>_<unit>`` (like Prometheus' BuildFQName); counters end in
``_total``; every metric has help text and a base unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NAMESPACE = "cri_resmgr"

MetricType = Literal["counter", "gauge"]


def fqname(subsystem: str, name: str, unit: str = "", counter: bool = False) -> str:
    parts = [NAMESPACE, subsystem, name]
    if unit and not name.endswith(unit):
        parts.append(unit)
    out = "_".join(p for p in parts if p)
    if counter and not out.endswith("_total"):
        out += "_total"
    return out


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    help: str
    unit: str = ""


_REGISTRY: dict[str, MetricSpec] = {}


def define(subsystem: str, name: str, type: MetricType, help: str, unit: str = "") -> MetricSpec:
    spec = MetricSpec(fqname(subsystem, name, unit, counter=type == "counter"), type, help, unit)
    prev = _REGISTRY.get(spec.name)
    if prev is not None and prev != spec:
        raise ValueError(f"metric {spec.name} defined twice with different metadata")
    _REGISTRY[spec.name] = spec
    return spec


def lookup(name: str) -> MetricSpec | None:
    return _REGISTRY.get(name)


def all_specs() -> dict[str, MetricSpec]:
    return dict(_REGISTRY)


CONTAINER_LABELS = ("namespace", "pod", "container", "container_id", "pod_uid", "qos_class")
CPU_LABELS = ("cpu", "core", "die", "numa_node", "package")

# cgroup collector
CONTAINER_CPU_USAGE = define("container", "cpu_usage", "counter", "CPU time consumed by the container.", "seconds")
CONTAINER_CPU_PERIODS = define("container", "cpu_cfs_periods", "counter", "Elapsed CFS enforcement periods.")
CONTAINER_CPU_THROTTLED_PERIODS = define(
    "container", "cpu_cfs_throttled_periods", "counter", "CFS periods in which the container was throttled."
)
CONTAINER_CPU_THROTTLED = define(
    "container", "cpu_cfs_throttled", "counter", "Time the container spent throttled by its CPU quota.", "seconds"
)
CONTAINER_MEMORY_USAGE = define(
    "container", "memory_usage", "gauge", "Memory charged to the container, page cache included.", "bytes"
)
CONTAINER_MEMORY_WORKING_SET = define(
    "container", "memory_working_set", "gauge",
    "Memory usage minus inactive file pages (what the kubelet evicts on).", "bytes",
)
CONTAINER_CPUSET_CPUS = define(
    "container", "cpuset_cpus", "gauge", "Number of CPUs in the container's effective cpuset; the label 'cpus' lists them."
)
# per-CPU collector (/proc/stat)
CPU_BUSY = define("cpu", "busy", "counter", "Non-idle time of the CPU (everything but idle and iowait).", "seconds")
CPU_UTILIZATION = define("cpu", "utilization", "gauge", "Busy fraction of the CPU over the last interval.", "ratio")
# agent self-metrics
COLLECTOR_UP = define("collector", "up", "gauge", "1 when the collector's source is available and working.")
COLLECTOR_DURATION = define("collector", "duration", "gauge", "Duration of the collector's last run.", "seconds")
COLLECTOR_ERRORS = define("collector", "errors", "counter", "Failed collector runs.")
CONFIG_RELOAD_ERRORS = define("config", "reload_errors", "counter", "Rejected configuration reloads.")
CONFIG_RELOADS = define("config", "reloads", "counter", "Accepted configuration reloads.")
STORE_SERIES = define("store", "series", "gauge", "Series held in the embedded store.")
STORE_DROPPED = define("store", "series_dropped", "counter", "Samples dropped because the store hit max_series.")
