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


def is_counter(name: str) -> bool:
    """The one rule for what counts as a counter: its name ends in ``_total`` (every counter defined here does,
    see :func:`fqname`, and Prometheus' naming convention says so for metrics stored without metadata)."""
    return name.endswith("_total")


def default_fn(name: str) -> Literal["rate", "raw"]:
    """The default query function for a metric: the per-second rate of a counter, the raw value of anything else."""
    return "rate" if is_counter(name) else "raw"


def spec_of(name: str) -> MetricSpec:
    """The declared metadata of ``name``, or what can be said of a metric stored without any."""
    spec = _REGISTRY.get(name)
    if spec is None:
        spec = MetricSpec(name, "counter" if is_counter(name) else "gauge", f"{name} (no metadata)")
    return spec


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
    "container", "cpuset_cpus", "gauge",
    "Number of CPUs in the container's effective cpuset. The CPU list itself is not a label (it would make a "
    "new series at every shared-pool change): /api/v1/containers gives it as 'cpuset'.",
    labels=CONTAINER_LABELS,
)
CONTAINER_PRESSURE_STALLED = define(
    "container", "pressure_stalled", "counter",
    "Time some (kind=some) or all (kind=full) of the container's tasks stalled on a resource (cpu|memory|io), "
    "from the cgroup v2 *.pressure files (PSI).", "seconds", labels=CONTAINER_LABELS + ("resource", "kind"),
)
# per-CPU collector (/proc/stat)
CPU_BUSY = define("cpu", "busy", "counter", "Non-idle time of the CPU (everything but idle and iowait).", "seconds",
                  labels=CPU_LABELS)
CPU_UTILIZATION = define("cpu", "utilization", "gauge", "Busy fraction of the CPU over the last interval.", "ratio",
                         labels=CPU_LABELS)
# perf collector (perf_event_open per cgroup and CPU; counts scaled for multiplexing)
CONTAINER_CYCLES = define("container", "cycles", "counter", "CPU cycles spent by the container's tasks (perf).",
                          labels=CONTAINER_LABELS)
CONTAINER_INSTRUCTIONS = define("container", "instructions", "counter", "Instructions retired by the container (perf).",
                                labels=CONTAINER_LABELS)
CONTAINER_LLC_REFERENCES = define("container", "llc_references", "counter", "Last-level cache references (perf).",
                                  labels=CONTAINER_LABELS)
CONTAINER_LLC_MISSES = define("container", "llc_misses", "counter", "Last-level cache misses (perf).",
                              labels=CONTAINER_LABELS)
CONTAINER_CPI = define("container", "cycles_per_instruction", "gauge",
                       "Cycles per instruction over the last perf interval (derived).", labels=CONTAINER_LABELS)
CONTAINER_PERF_CPU_CLOCK = define("container", "cpu_clock", "counter",
                                  "CPU time seen by the perf cpu-clock software event.", "seconds",
                                  labels=CONTAINER_LABELS)
# The avx512 collector owns cri_resmgr_container_context_switches_total (sched_switch, the ratio's denominator);
# the perf software event of the same meaning gets its own name so the two sources never overwrite each other.
CONTAINER_CONTEXT_SWITCHES = define("container", "context_switches", "counter",
                                    "Context switches out of the container's tasks (eBPF on sched:sched_switch).",
                                    labels=CONTAINER_LABELS)
CONTAINER_PERF_CONTEXT_SWITCHES = define("container", "perf_context_switches", "counter",
                                         "Context switches (perf software event).", labels=CONTAINER_LABELS)
CONTAINER_PAGE_FAULTS = define("container", "page_faults", "counter", "Page faults (perf software event).",
                               labels=CONTAINER_LABELS)
CONTAINER_PERF_EVENTS = define("container", "perf_events", "counter",
                               "Count of a configured raw or perfmon perf event; the label 'event' names it.",
                               labels=CONTAINER_LABELS + ("event",))
CONTAINER_PERF_MONITORED = define("container", "perf_monitored", "gauge",
                                  "1 when perf counters are open for the container, 0 when skipped (label 'reason').",
                                  labels=CONTAINER_LABELS + ("reason",))
PERF_DESCRIPTORS = define("perf", "open_descriptors", "gauge", "perf_event file descriptors held by the agent.",
                          labels=())
CONTAINER_PERF_ENABLED = define(
    "container", "perf_enabled", "counter",
    "Time the container's perf event groups were enabled, summed over CPUs (perf time_enabled).", "seconds",
    labels=CONTAINER_LABELS)
CONTAINER_PERF_RUNNING = define(
    "container", "perf_running", "counter",
    "Time the container's perf event groups were on a hardware counter, summed over CPUs (perf time_running); "
    "below perf_enabled when events multiplex, and the counts are scaled by enabled / running.", "seconds",
    labels=CONTAINER_LABELS)
CONTAINER_PERF_DESCRIPTORS = define("container", "perf_descriptors", "gauge",
                                    "perf_event descriptors open for the container (CPUs of its cpuset x events).",
                                    labels=CONTAINER_LABELS)
PERF_DESCRIPTOR_BUDGET = define("perf", "descriptor_budget", "gauge",
                                "Most perf_event descriptors the agent may hold.", labels=())
PERF_EVENT_SUPPORTED = define("perf", "event_supported", "gauge",
                              "1 when the kernel accepted the configured event, 0 when not (label 'error').",
                              labels=("event", "error"))
PERF_CONTAINERS_SKIPPED = define("perf", "containers_skipped", "gauge",
                                 "Containers not counted by perf (budget, no cgroup).", labels=())
# RDT collector (resctrl MON groups)
CONTAINER_MEMORY_BANDWIDTH = define(
    "container", "memory_bandwidth", "counter",
    "Memory traffic of the container from RDT MBM (scope total|local, per L3 cache_id).", "bytes",
    labels=CONTAINER_LABELS + ("scope", "cache_id"))
CONTAINER_LLC_OCCUPANCY = define("container", "llc_occupancy", "gauge",
                                 "Last-level cache held by the container from RDT CMT, per L3 cache_id.", "bytes",
                                 labels=CONTAINER_LABELS + ("cache_id",))
CONTAINER_RDT_MONITORED = define("container", "rdt_monitored", "gauge",
                                 "1 when the container has a resctrl monitoring group, 0 when not (label 'reason').",
                                 labels=CONTAINER_LABELS + ("reason",))
NODE_MEMORY_BANDWIDTH = define("node", "memory_bandwidth", "counter",
                               "Memory traffic of all tasks per L3 domain from RDT MBM (scope total|local).", "bytes",
                               labels=("scope", "cache_id"))
NODE_LLC_OCCUPANCY = define("node", "llc_occupancy", "gauge", "Last-level cache occupancy of all tasks per L3 domain.",
                            "bytes", labels=("cache_id",))
RDT_RMIDS = define("rdt", "rmids", "gauge", "RMIDs the hardware offers (info/L3_MON/num_rmids).", labels=())
RDT_MON_GROUPS = define("rdt", "mon_groups", "gauge", "Monitoring groups the agent holds.", labels=())
RDT_RMID_BUDGET = define("rdt", "rmid_budget", "gauge",
                         "MON groups the agent can hold: num_rmids minus the others' groups, lowered after ENOSPC.",
                         labels=())
CONTAINER_RDT_MONITORED_SECONDS = define(
    "container", "rdt_monitored", "counter",
    "Time the container's memory traffic is known since its first watch: in a MON group, or without one while "
    "its CPU usage stood still (no task ran, so no traffic). memory_bandwidth_bytes_total is the bytes counted "
    "times elapsed over this time (equal when known all along, as without rotation).", "seconds",
    labels=CONTAINER_LABELS)
RDT_WRITE_ERRORS = define("rdt", "write_errors", "counter", "Failed resctrl writes and mkdirs (info/last_cmd_status).",
                          labels=())
# SST collector (cpufreq base_frequency, isst interface)
CPU_BASE_FREQUENCY = define("cpu", "base_frequency", "gauge", "Base frequency of the CPU (cpufreq base_frequency).",
                            "hertz", labels=CPU_LABELS)
CPU_SST_BF_HIGH_PRIORITY = define(
    "cpu", "sst_bf_high_priority", "gauge",
    "1 when the CPU is an SST-BF high-priority core (base frequency above its package's lowest).", labels=CPU_LABELS)
NODE_SST_BF_ENABLED = define("node", "sst_bf_enabled", "gauge", "1 when some package has SST-BF high-priority cores.",
                             labels=())
NODE_SST_PP_LEVEL = define("node", "sst_pp_level", "gauge", "Current SST-PP performance level per package.",
                           labels=("package",))
NODE_SST_PP_MAX_LEVEL = define("node", "sst_pp_max_level", "gauge", "Highest SST-PP performance level per package.",
                               labels=("package",))
NODE_SST_PP_STATUS = define("node", "sst_pp_status", "gauge",
                            "1 for the SST-PP state in label 'status' (enabled, disabled, locked, unknown).",
                            labels=("package", "status"))
# avx512 collector (eBPF on x86_fpu:x86_fpu_regs_deactivated and sched:sched_switch; docs/avx512.md). It also
# writes CONTAINER_CONTEXT_SWITCHES (above): every switch out of the container's tasks, from sched_switch.
CONTAINER_AVX512_SWITCHES = define(
    "container", "avx512_switches", "counter",
    "Context switches out of the container's tasks that saved live AVX-512 state (XSAVE ZMM_Hi256 in use).",
    labels=CONTAINER_LABELS
)
CONTAINER_AVX512_RATIO = define(
    "container", "avx512", "gauge",
    "Share of the container's context switches with AVX-512 state in use, over collectors.avx512.window_seconds.",
    "ratio", labels=CONTAINER_LABELS
)
CONTAINER_AVX512_ACTIVE = define(
    "container", "avx512_active", "gauge",
    "1 while the container's AVX-512 ratio is above collectors.avx512.active_threshold (with hysteresis), else 0.",
    labels=CONTAINER_LABELS
)
CONTAINER_AVX512_LAST_USE = define(
    "container", "avx512_last_use_timestamp", "gauge",
    "Unix time of the container's last context switch with AVX-512 state in use.", "seconds", labels=CONTAINER_LABELS
)
CPU_AVX512_SWITCHES = define(
    "cpu", "avx512_switches", "counter", "Context switches on the CPU that saved live AVX-512 state (all tasks).",
    labels=CPU_LABELS
)
CPU_AVX512_RATIO = define(
    "cpu", "avx512", "gauge", "Share of the CPU's context switches with AVX-512 state in use, over the window.",
    "ratio", labels=CPU_LABELS,
)
AVX512_MAP_ENTRIES = define("avx512", "map_entries", "gauge", "Keys in the eBPF per-CPU counts map.", labels=())
AVX512_MAP_CAPACITY = define("avx512", "map_capacity", "gauge", "max_entries of the eBPF counts map.", labels=())
AVX512_MAP_INSERT_FAILURES = define(
    "avx512", "map_insert_failures", "counter",
    "Events not attributed to a cgroup or process because the counts map was full (raise map_entries).", labels=()
)
# rebalancer
REBALANCER_MOVES = define("rebalancer", "moves", "counter",
                          "Moves planned by the rebalancer, by result (applied, failed, advised).", labels=("result",))
REBALANCER_COST = define("rebalancer", "cost", "gauge",
                         "Interference cost rate of the node before and after the last plan (when=before|after).",
                         labels=("when",))
REBALANCER_PLAN_DURATION = define("rebalancer", "plan_duration", "gauge",
                                  "Time the last rebalancing round took to read inputs and plan.", "seconds", labels=())
REBALANCER_ROUNDS = define("rebalancer", "rounds", "counter",
                           "Rebalancer rounds of the agent's loop, by result: planned, or skipped (no input had "
                           "changed by more than rebalancer.skip_threshold since the last planned round).",
                           labels=("result",))
# agent self-metrics
COLLECTOR_UP = define("collector", "up", "gauge", "1 when the collector's source is available and working.",
                      labels=("collector",))
COLLECTOR_DURATION = define("collector", "duration", "gauge", "Duration of the collector's last run.", "seconds",
                            labels=("collector",))
COLLECTOR_ERRORS = define("collector", "errors", "counter", "Failed collector runs.", labels=("collector",))
CONFIG_RELOAD_ERRORS = define("config", "reload_errors", "counter", "Rejected configuration reloads.", labels=())
CONFIG_RELOADS = define("config", "reloads", "counter", "Accepted configuration reloads.", labels=())
STORE_SERIES = define("store", "series", "gauge", "Series held in the embedded store.", labels=())
STORE_DROPPED = define("store", "series_dropped", "counter",
                       "New series refused because the store held store.max_series series.", labels=())
STORE_CHECKPOINT_ERRORS = define("store", "checkpoint_errors", "counter",
                                 "Periodic checkpoints of the store that failed (retried next interval).", labels=())
STORE_ROWS_OUT_OF_ORDER = define("store", "rows_out_of_order", "counter",
                                 "Rows refused because their time was before a table's newest row.", labels=())
LOOP_RESTARTS = define("agent", "loop_restarts", "counter",
                       "Restarts of a supervised background loop after an error (see /api/v1/loops).",
                       labels=("loop",))
CLOCK_AHEAD = define("agent", "clock_ahead", "gauge",
                     "How far sample timestamps run ahead of the wall clock after it stepped back.", "seconds",
                     labels=())
STORE_FAMILY_SERIES = define("store", "family_series", "gauge",
                             "Series held in the store per metric family (cardinality; see series.disable).",
                             labels=("family",))
SERIES_DISABLED_SAMPLES = define("series", "disabled_samples", "counter",
                                 "Samples not stored because their family is listed in series.disable.",
                                 labels=("family",))
# remote_write (export/remote_write.py)
REMOTE_WRITE_SENT = define("remote_write", "samples_sent", "counter", "Samples the remote-write receiver accepted.",
                           labels=())
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
# resource controls (placement engine controllers; docs/resource-control.md)
CONTAINER_RDT_CLASS = define(
    "container", "rdt_class", "gauge",
    "1 when the container is in the RDT class of label 'class', 0 when that class could not be enforced.",
    labels=CONTAINER_LABELS + ("class",),
)
CONTAINER_BLOCKIO_CLASS = define(
    "container", "blockio_class", "gauge",
    "1 when the container is in the block-IO class of label 'class', 0 when that class could not be enforced.",
    labels=CONTAINER_LABELS + ("class",),
)
CONTAINER_RT_CLASS = define(
    "container", "rt_class", "gauge",
    "1 when the container is in the real-time class of label 'class', 0 when that class could not be enforced.",
    labels=CONTAINER_LABELS + ("class",),
)
CONTROL_CLASS_CONTAINERS = define("control", "class_containers", "gauge",
                                  "Containers enforced in each class of each control (labels control, class).",
                                  labels=("control", "class"))
CONTROL_ERRORS = define("control", "errors", "counter",
                        "Failed enforcements and releases of a control (label control).", labels=("control",))
# CRI relay (a process of its own: cri-resmgr relay; docs/relay.md)
RELAY_REQUESTS = define("relay", "requests", "counter", "CRI calls through the relay, by method and gRPC status code.",
                        labels=("method", "code"))
RELAY_REQUEST_DURATION = define(
    "relay", "request_duration", "histogram", "Time from a CRI call's request headers to its end, through the relay.",
    "seconds", labels=("method",)
)
RELAY_RUNTIME_UP = define("relay", "runtime_up", "gauge", "1 when the relay reaches the container runtime.", labels=())
RELAY_EXCLUSIVE_CPUS = define("relay", "exclusive_cpus", "gauge", "CPUs given exclusively to containers.", labels=())
RELAY_SHARED_POOL_CPUS = define("relay", "shared_pool_cpus", "gauge", "CPUs in the shared pool.", labels=())
RELAY_MOVES = define("relay", "moves", "counter", "Container moves applied by the relay (rebalancer requests).",
                     labels=())
RELAY_INVARIANT_VIOLATIONS = define(
    "relay", "invariant_violations", "counter",
    "Placement invariant violations found in the kernel's cgroup cpuset files (after every reconcile and on demand).",
    labels=())
RELAY_INVARIANT_REPAIRS = define("relay", "invariant_repairs", "counter",
                                 "Containers re-pinned to repair a placement invariant violation.", labels=())
RELAY_REWRITE_ROLLBACKS = define(
    "relay", "rewrite_rollbacks", "counter",
    "Rewrites that failed: the runtime got the original request and the cache was rolled back to it.", labels=())
RELAY_CACHE_SAVE_FAILURES = define("relay", "cache_save_failures", "counter",
                                   "Cache saves that failed (e.g. ENOSPC); the previous file was kept.", labels=())
RELAY_CACHE_CORRUPT = define("relay", "cache_corrupt", "counter",
                             "Unusable cache files moved aside at start (state rebuilt from the runtime).", labels=())
RELAY_THREAD_RESTARTS = define("relay", "thread_restarts", "counter",
                               "Background threads restarted after an unexpected error.", labels=())
RELAY_START_HOLD_TIMEOUTS = define(
    "relay", "start_hold_timeouts", "counter",
    "Starts (or growing resizes) let through before shared containers had left the container's CPUs.", labels=())
RELAY_POOL_UPDATE_FAILURES = define("relay", "pool_update_failures", "counter",
                                    "Shared-pool cpuset updates the runtime failed (retried).", labels=())
RELAY_CONTROLLER_ERRORS = define("relay", "controller_errors", "counter",
                                 "Resource controller hook calls that raised.", labels=())
RELAY_STREAMS_RESET = define(
    "relay", "streams_reset", "counter",
    "Streams or connections the relay ended itself: a header block or held message over its limit.",
    labels=("reason",))
RELAY_EVENT_LOOP_NICE = define(
    "relay", "event_loop_nice", "gauge",
    "Nice of the relay's event-loop thread (the one forwarding every call), read back from the kernel: "
    "relay.event_loop_nice when granted.", labels=())
# NRI plugin (a process of its own: cri-resmgr nri; docs/nri.md)
NRI_REQUESTS = define(
    "nri", "requests", "counter",
    "Runtime requests the NRI plugin answered, by event and result (ok, error, timeout: let through unchanged).",
    labels=("event", "result"),
)
NRI_REQUEST_DURATION = define(
    "nri", "request_duration", "histogram", "Time the NRI plugin took to answer a runtime request.", "seconds",
    labels=("event",),
)
NRI_CONNECTED = define("nri", "connected", "gauge", "1 while the plugin is registered with the runtime.", labels=())
NRI_REQUEST_TIME = define(
    "nri", "request_time", "counter",
    "Where the NRI plugin's answer time went, by event and part: cpu (the answering thread on a CPU), runqueue "
    "(runnable, waiting for a CPU), blocked (waiting for the interpreter lock, a lock or I/O), steal (not on a CPU, "
    "not asleep, not queued: the hypervisor's steal time or interrupts).", "seconds",
    labels=("event", "part"),
)
NRI_SLOW_REQUESTS = define(
    "nri", "slow_requests", "counter",
    "NRI requests answered in more than 2 ms, by event and their largest part (cpu, runqueue, blocked, steal, gc).",
    labels=("event", "cause"),
)
NRI_GC_PAUSES = define("nri", "gc_pauses", "counter", "Garbage collections in the NRI plugin, by generation.",
                       labels=("generation",))
NRI_GC_PAUSE_TIME = define("nri", "gc_pause_time", "counter",
                           "Time the NRI plugin spent in garbage collection, by generation.", "seconds",
                           labels=("generation",))
