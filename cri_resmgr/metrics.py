"""Metric names and metadata, built in one place.

Names follow ``cri_resmgr_<subsystem>_<name>_<unit>`` (like Prometheus' BuildFQName); counters end in
``_total``; every metric has help text and a base unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NAMESPACE = "cri_resmgr"

MetricType = Literal["counter", "gauge", "histogram"]


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
    labels: tuple[str, ...] | None = None  # label names its series carry; None: not declared (docs/metrics.md)


_REGISTRY: dict[str, MetricSpec] = {}


def define(subsystem: str, name: str, type: MetricType, help: str, unit: str = "",
           labels: tuple[str, ...] | None = None) -> MetricSpec:
    spec = MetricSpec(fqname(subsystem, name, unit, counter=type == "counter"), type, help, unit,
                      tuple(labels) if labels is not None else None)
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
CONTAINER_CPU_USAGE = define("container", "cpu_usage", "counter", "CPU time consumed by the container.", "seconds",
                             labels=CONTAINER_LABELS)
CONTAINER_CPU_PERIODS = define("container", "cpu_cfs_periods", "counter", "Elapsed CFS enforcement periods.",
                               labels=CONTAINER_LABELS)
CONTAINER_CPU_THROTTLED_PERIODS = define(
    "container", "cpu_cfs_throttled_periods", "counter", "CFS periods in which the container was throttled.",
    labels=CONTAINER_LABELS,
)
CONTAINER_CPU_THROTTLED = define(
    "container", "cpu_cfs_throttled", "counter", "Time the container spent throttled by its CPU quota.", "seconds",
    labels=CONTAINER_LABELS,
)
CONTAINER_MEMORY_USAGE = define(
    "container", "memory_usage", "gauge", "Memory charged to the container, page cache included.", "bytes",
    labels=CONTAINER_LABELS,
)
CONTAINER_MEMORY_WORKING_SET = define(
    "container", "memory_working_set", "gauge",
    "Memory usage minus inactive file pages (what the kubelet evicts on).", "bytes", labels=CONTAINER_LABELS,
)
CONTAINER_CPUSET_CPUS = define(
    "container", "cpuset_cpus", "gauge", "Number of CPUs in the container's effective cpuset; the label 'cpus' lists them.",
    labels=CONTAINER_LABELS + ("cpus",),
)
# per-CPU collector (/proc/stat)
CPU_BUSY = define("cpu", "busy", "counter", "Non-idle time of the CPU (everything but idle and iowait).", "seconds",
                  labels=CPU_LABELS)
CPU_UTILIZATION = define("cpu", "utilization", "gauge", "Busy fraction of the CPU over the last interval.", "ratio",
                         labels=CPU_LABELS)
# perf collector (perf_event_open per cgroup and CPU; counts scaled for multiplexing)
CONTAINER_CYCLES = define("container", "cycles", "counter", "CPU cycles spent by the container's tasks (perf).")
CONTAINER_INSTRUCTIONS = define("container", "instructions", "counter", "Instructions retired by the container (perf).")
CONTAINER_LLC_REFERENCES = define("container", "llc_references", "counter", "Last-level cache references (perf).")
CONTAINER_LLC_MISSES = define("container", "llc_misses", "counter", "Last-level cache misses (perf).")
CONTAINER_CPI = define("container", "cycles_per_instruction", "gauge",
                       "Cycles per instruction over the last perf interval (derived).")
CONTAINER_PERF_CPU_CLOCK = define("container", "cpu_clock", "counter",
                                  "CPU time seen by the perf cpu-clock software event.", "seconds")
# The avx512 collector owns cri_resmgr_container_context_switches_total (sched_switch, the ratio's denominator);
# the perf software event of the same meaning gets its own name so the two sources never overwrite each other.
CONTAINER_CONTEXT_SWITCHES = define("container", "context_switches", "counter",
                                    "Context switches out of the container's tasks (eBPF on sched:sched_switch).")
CONTAINER_PERF_CONTEXT_SWITCHES = define("container", "perf_context_switches", "counter",
                                         "Context switches (perf software event).")
CONTAINER_PAGE_FAULTS = define("container", "page_faults", "counter", "Page faults (perf software event).")
CONTAINER_PERF_EVENTS = define("container", "perf_events", "counter",
                               "Count of a configured raw or perfmon perf event; the label 'event' names it.")
CONTAINER_PERF_MONITORED = define("container", "perf_monitored", "gauge",
                                  "1 when perf counters are open for the container, 0 when skipped (label 'reason').")
PERF_DESCRIPTORS = define("perf", "open_descriptors", "gauge", "perf_event file descriptors held by the agent.")
PERF_DESCRIPTOR_BUDGET = define("perf", "descriptor_budget", "gauge", "Most perf_event descriptors the agent may hold.")
PERF_EVENT_SUPPORTED = define("perf", "event_supported", "gauge",
                              "1 when the kernel accepted the configured event, 0 when not (label 'error').")
PERF_CONTAINERS_SKIPPED = define("perf", "containers_skipped", "gauge", "Containers not counted by perf (budget, no cgroup).")
# RDT collector (resctrl MON groups)
CONTAINER_MEMORY_BANDWIDTH = define("container", "memory_bandwidth", "counter",
                                    "Memory traffic of the container from RDT MBM (scope total|local, per L3 cache_id).",
                                    "bytes")
CONTAINER_LLC_OCCUPANCY = define("container", "llc_occupancy", "gauge",
                                 "Last-level cache held by the container from RDT CMT, per L3 cache_id.", "bytes")
CONTAINER_RDT_MONITORED = define("container", "rdt_monitored", "gauge",
                                 "1 when the container has a resctrl monitoring group, 0 when not (label 'reason').")
NODE_MEMORY_BANDWIDTH = define("node", "memory_bandwidth", "counter",
                               "Memory traffic of all tasks per L3 domain from RDT MBM (scope total|local).", "bytes")
NODE_LLC_OCCUPANCY = define("node", "llc_occupancy", "gauge", "Last-level cache occupancy of all tasks per L3 domain.",
                            "bytes")
RDT_RMIDS = define("rdt", "rmids", "gauge", "RMIDs the hardware offers (info/L3_MON/num_rmids).")
RDT_MON_GROUPS = define("rdt", "mon_groups", "gauge", "Monitoring groups the agent holds.")
RDT_WRITE_ERRORS = define("rdt", "write_errors", "counter", "Failed resctrl writes and mkdirs (info/last_cmd_status).")
# SST collector (cpufreq base_frequency, isst interface)
CPU_BASE_FREQUENCY = define("cpu", "base_frequency", "gauge", "Base frequency of the CPU (cpufreq base_frequency).", "hertz")
CPU_SST_BF_HIGH_PRIORITY = define("cpu", "sst_bf_high_priority", "gauge",
                                  "1 when the CPU is an SST-BF high-priority core (base frequency above its package's lowest).")
NODE_SST_BF_ENABLED = define("node", "sst_bf_enabled", "gauge", "1 when some package has SST-BF high-priority cores.")
NODE_SST_PP_LEVEL = define("node", "sst_pp_level", "gauge", "Current SST-PP performance level per package.")
NODE_SST_PP_MAX_LEVEL = define("node", "sst_pp_max_level", "gauge", "Highest SST-PP performance level per package.")
NODE_SST_PP_STATUS = define("node", "sst_pp_status", "gauge",
                            "1 for the SST-PP state in label 'status' (enabled, disabled, locked, unknown).")
# avx512 collector (eBPF on x86_fpu:x86_fpu_regs_deactivated and sched:sched_switch; docs/avx512.md). It also
# writes CONTAINER_CONTEXT_SWITCHES (above): every switch out of the container's tasks, from sched_switch.
CONTAINER_AVX512_SWITCHES = define(
    "container", "avx512_switches", "counter",
    "Context switches out of the container's tasks that saved live AVX-512 state (XSAVE ZMM_Hi256 in use).",
)
CONTAINER_AVX512_RATIO = define(
    "container", "avx512", "gauge",
    "Share of the container's context switches with AVX-512 state in use, over collectors.avx512.window_seconds.",
    "ratio",
)
CONTAINER_AVX512_ACTIVE = define(
    "container", "avx512_active", "gauge",
    "1 while the container's AVX-512 ratio is above collectors.avx512.active_threshold (with hysteresis), else 0.",
)
CONTAINER_AVX512_LAST_USE = define(
    "container", "avx512_last_use_timestamp", "gauge",
    "Unix time of the container's last context switch with AVX-512 state in use.", "seconds",
)
CPU_AVX512_SWITCHES = define(
    "cpu", "avx512_switches", "counter", "Context switches on the CPU that saved live AVX-512 state (all tasks)."
)
CPU_AVX512_RATIO = define(
    "cpu", "avx512", "gauge", "Share of the CPU's context switches with AVX-512 state in use, over the window.", "ratio"
)
AVX512_MAP_ENTRIES = define("avx512", "map_entries", "gauge", "Keys in the eBPF per-CPU counts map.")
AVX512_MAP_CAPACITY = define("avx512", "map_capacity", "gauge", "max_entries of the eBPF counts map.")
AVX512_MAP_INSERT_FAILURES = define(
    "avx512", "map_insert_failures", "counter",
    "Events not attributed to a cgroup or process because the counts map was full (raise map_entries).",
)
# rebalancer
REBALANCER_MOVES = define("rebalancer", "moves", "counter",
                          "Moves planned by the rebalancer, by result (applied, failed, advised).")
REBALANCER_COST = define("rebalancer", "cost", "gauge",
                         "Interference cost rate of the node before and after the last plan (when=before|after).")
REBALANCER_PLAN_DURATION = define("rebalancer", "plan_duration", "gauge",
                                  "Time the last rebalancing round took to read inputs and plan.", "seconds")
# agent self-metrics
COLLECTOR_UP = define("collector", "up", "gauge", "1 when the collector's source is available and working.",
                      labels=("collector",))
COLLECTOR_DURATION = define("collector", "duration", "gauge", "Duration of the collector's last run.", "seconds",
                            labels=("collector",))
COLLECTOR_ERRORS = define("collector", "errors", "counter", "Failed collector runs.", labels=("collector",))
CONFIG_RELOAD_ERRORS = define("config", "reload_errors", "counter", "Rejected configuration reloads.", labels=())
CONFIG_RELOADS = define("config", "reloads", "counter", "Accepted configuration reloads.", labels=())
STORE_SERIES = define("store", "series", "gauge", "Series held in the embedded store.", labels=())
STORE_DROPPED = define("store", "series_dropped", "counter", "Samples dropped because the store hit max_series.", labels=())
# remote_write (export/remote_write.py)
REMOTE_WRITE_SENT = define("remote_write", "samples_sent", "counter", "Samples the remote-write receiver accepted.", labels=())
REMOTE_WRITE_FAILED = define(
    "remote_write", "samples_failed", "counter",
    "Samples the receiver rejected with a non-retryable status (4xx other than 429); not sent again.", labels=(),
)
REMOTE_WRITE_DROPPED = define(
    "remote_write", "samples_dropped", "counter",
    "Samples dropped unsent because the queue was full (export.remote_write.queue_max) or the store overwrote them.",
    labels=(),
)
REMOTE_WRITE_RETRIES = define(
    "remote_write", "retries", "counter", "Requests retried after a connection error, timeout, 5xx or 429.", labels=()
)
REMOTE_WRITE_PENDING = define("remote_write", "pending_samples", "gauge", "Samples queued or in flight.", labels=())
REMOTE_WRITE_LAST_SUCCESS = define(
    "remote_write", "last_success_timestamp", "gauge", "Unix time of the last accepted request.", "seconds", labels=()
)
# CRI relay (a process of its own: cri-resmgr relay; docs/relay.md)
RELAY_REQUESTS = define("relay", "requests", "counter", "CRI calls through the relay, by method and gRPC status code.")
RELAY_REQUEST_DURATION = define(
    "relay", "request_duration", "histogram", "Time from a CRI call's request headers to its end, through the relay.",
    "seconds",
)
RELAY_RUNTIME_UP = define("relay", "runtime_up", "gauge", "1 when the relay reaches the container runtime.")
RELAY_EXCLUSIVE_CPUS = define("relay", "exclusive_cpus", "gauge", "CPUs given exclusively to containers.")
RELAY_SHARED_POOL_CPUS = define("relay", "shared_pool_cpus", "gauge", "CPUs in the shared pool.")
RELAY_MOVES = define("relay", "moves", "counter", "Container moves applied by the relay (rebalancer requests).")
