"""One typed configuration model for the agent.

Sources, lowest precedence first:

1. the model's defaults (the agent runs on these alone);
2. the YAML file given with ``--config``;
3. ``node_overrides[<node name>]`` from that file, where the node name comes from
   ``node_name``, else ``NODE_NAME``, else the hostname;
4. environment variables ``CRI_RESMGR_<KEY>``, nested keys joined by ``__``
   (``CRI_RESMGR_PATHS__SYSFS=/tmp/sys``); values are parsed as YAML scalars;
5. command-line flags (``--listen``, ``--state-dir``, ...).

Every error is reported as ``<key.path>: <problem>`` so that a user can find the
offending line; :class:`ConfigError` carries the list.
"""

from __future__ import annotations

import copy
import ipaddress
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

ENV_PREFIX = "CRI_RESMGR_"
# Bounds of every loop interval: below, a loop would spin (1e-6 s was accepted once); above, it never runs.
MIN_INTERVAL_SECONDS = 0.1
MAX_INTERVAL_SECONDS = 86400.0


class ConfigError(Exception):
    """A configuration that cannot be used; ``problems`` are ``key.path: message`` lines."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))

    def render(self) -> str:
        lines = [f"invalid configuration ({self.source}):"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


class _Strict(BaseModel):
    # Unknown keys are errors, not silently ignored: a typo must not fall back to a default.
    model_config = ConfigDict(extra="forbid", validate_default=True)


class Paths(_Strict):
    """Filesystem roots. Every file the agent reads lives under one of these."""

    sysfs: Path = Path("/sys")
    cgroup: Path = Path("/sys/fs/cgroup")
    proc: Path = Path("/proc")
    resctrl: Path = Path("/sys/fs/resctrl")
    dev: Path = Field(Path("/dev"), description="device nodes (block-IO class device patterns)")


class StoreConfig(_Strict):
    retention_seconds: float = Field(3600.0, ge=10, le=30 * 86400, description="how much history each series keeps")
    resolution_seconds: float = Field(
        1.0, gt=0, description="finest expected sample interval; sizes the ring buffers"
    )
    checkpoint: bool = Field(True, description="write the store to state_dir and restore it at start")
    checkpoint_interval_seconds: float = Field(60.0, ge=1, le=86400)
    max_series: int = Field(200_000, gt=0, le=10_000_000, description="series beyond this are dropped and counted")


class ExtraCgroup(_Strict):
    """A cgroup outside the Kubernetes hierarchy to watch as if it were a container."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1, description="path relative to the cgroup root, e.g. 'demo/busy'")
    namespace: str = "default"
    pod: str = ""


class CgroupCollectorConfig(_Strict):
    enabled: bool = True
    interval_seconds: float = Field(5.0, ge=MIN_INTERVAL_SECONDS, le=MAX_INTERVAL_SECONDS)
    extra_cgroups: list[ExtraCgroup] = Field(default_factory=list)
    runtime_socket: Path | None = Field(
        Path("/run/containerd/containerd.sock"),
        description="CRI socket asked for pod and container names (labels namespace, pod, container); none: off",
    )
    names_refresh_seconds: float = Field(10.0, ge=1, le=86400)
    pressure: bool = Field(True, description="per-container PSI (cpu/memory/io.pressure of the v2 cgroup)")
    idle_refresh_seconds: float = Field(
        30.0, ge=0, le=3600,
        description="a container whose CPU usage and cpuset did not change since the last run has its other files "
                    "(memory, throttling, PSI) read at least this often, staggered over the runs; its series repeat "
                    "the last values in between. 0: read every file of every container every run")


class CpuCollectorConfig(_Strict):
    enabled: bool = True
    interval_seconds: float = Field(2.0, ge=MIN_INTERVAL_SECONDS, le=MAX_INTERVAL_SECONDS)


class Avx512CollectorConfig(_Strict):
    """AVX-512 use per container from eBPF on the x86_fpu and sched tracepoints (docs/avx512.md)."""

    enabled: bool = True
    interval_seconds: float = Field(2.0, ge=MIN_INTERVAL_SECONDS, le=MAX_INTERVAL_SECONDS)
    window_seconds: float = Field(10.0, gt=0, description="window of the AVX-512 ratio")
    active_threshold: float = Field(0.1, gt=0, le=1, description="ratio from which a container is AVX-512 active")
    active_hysteresis: float = Field(
        0.5, ge=0, lt=1, description="active clears only below threshold x (1 - hysteresis)"
    )
    map_entries: int = Field(4096, ge=64, le=1 << 20, description="keys of the per-CPU counts map")
    loader: Literal["auto", "libbpf", "bcc"] = Field("auto", description="auto: libbpf CO-RE, else bcc")
    attribution: Literal["auto", "cgroup_id", "pid"] = Field(
        "auto", description="auto: cgroup id where a v2 tree exists, else the task's pid"
    )
    object_path: Path | None = Field(None, description="BPF object; default: the one `make bpf` builds")
    kernel_modules_dir: Path = Field(Path("/lib/modules"), description="where bcc finds kernel headers")

    @model_validator(mode="after")
    def _check_window(self) -> Avx512CollectorConfig:
        if self.window_seconds < self.interval_seconds:
            raise ValueError(f"window_seconds ({self.window_seconds}) must be at least interval_seconds "
                             f"({self.interval_seconds})")
        return self


class PerfPriority(_Strict):
    """Containers matching every field (shell-style globs) are watched before the busiest ones."""

    namespace: str = "*"
    pod: str = "*"
    container: str = "*"
    container_id: str = "*"


class PerfCollectorConfig(_Strict):
    """perf_event counters per container (docs/hardware-collectors.md)."""

    enabled: bool = True
    interval_seconds: float = Field(2.0, ge=MIN_INTERVAL_SECONDS, le=MAX_INTERVAL_SECONDS)
    events: list[str] = Field(
        default_factory=lambda: ["cycles", "instructions", "cache-references", "cache-misses"],
        min_length=1, description="generic names, rNNNN raw codes, perfmon names; 'metric=event' to alias",
    )
    perfmon_path: Path | None = Field(None, description="Intel perfmon JSON file or directory for event names")
    max_descriptors: int = Field(4096, ge=1, description="at most this many perf fds (containers x CPUs x events)")
    priority: list[PerfPriority] = Field(default_factory=list, description="watched first, then the busiest")
    extra_cgroups_first: bool = Field(True, description="collectors.cgroup.extra_cgroups count as priority")
    reselect_interval_seconds: float = Field(30.0, gt=0, description="how often the busiest are re-ranked")
    cpuset_only: bool = Field(True, description="open a container's events only on the CPUs of its cpuset")


class RdtCollectorConfig(_Strict):
    """resctrl MBM/CMT monitoring groups per container (docs/hardware-collectors.md)."""

    enabled: bool = True
    interval_seconds: float = Field(2.0, ge=MIN_INTERVAL_SECONDS, le=MAX_INTERVAL_SECONDS)
    control_group: str = Field("", description="CTRL_MON group holding the containers' MON groups; '' = root")
    mbm_counter_width_bits: int = Field(64, ge=8, le=64, description="bits after which an MBM file value wraps")
    priority: list[PerfPriority] = Field(
        default_factory=list, description="containers that keep a MON group when RMIDs run short")
    qos_order: list[str] = Field(default_factory=lambda: ["Guaranteed", "Burstable", "BestEffort"],
                                 description="QoS classes in the order they get MON groups when RMIDs run short")
    rank_by_cpu: bool = Field(True, description="within a QoS class, the busiest containers first")
    priority_annotation: str = Field("rdt-monitor.cri-resource-manager.intel.com",
                                     description="pod annotation <this>/pod or <this>/container.<name> = true: "
                                                 "priority")
    rotation_slice_seconds: float = Field(10.0, gt=0, description="how long a rotating container keeps its MON group")
    rotation_share: float = Field(0.25, gt=0, le=1, description="share of the RMID budget that rotates")


class SstCollectorConfig(_Strict):
    """SST-BF from cpufreq base frequencies, SST-PP from the isst interface (docs/hardware-collectors.md)."""

    enabled: bool = True
    interval_seconds: float = Field(30.0, ge=MIN_INTERVAL_SECONDS, le=MAX_INTERVAL_SECONDS)
    isst_device: Path = Field(Path("/dev/isst_interface"), description="Intel Speed Select character device")


class SeriesConfig(_Strict):
    """Which metric families are stored and with which labels (docs/hardware-collectors.md)."""

    disable: list[str] = Field(default_factory=list,
                               description="metric families (or fnmatch patterns) not collected into the store")
    drop_labels: dict[str, list[str]] = Field(
        default_factory=dict, description="family (or pattern) -> labels removed; coinciding series are summed")


class Collectors(_Strict):
    cgroup: CgroupCollectorConfig = Field(default_factory=CgroupCollectorConfig)
    cpu: CpuCollectorConfig = Field(default_factory=CpuCollectorConfig)
    avx512: Avx512CollectorConfig = Field(default_factory=Avx512CollectorConfig)
    perf: PerfCollectorConfig = Field(default_factory=PerfCollectorConfig)
    rdt: RdtCollectorConfig = Field(default_factory=RdtCollectorConfig)
    sst: SstCollectorConfig = Field(default_factory=SstCollectorConfig)


class RebalancerWeights(_Strict):
    """Weights of the interference terms (docs/rebalancer.md explains each term and its unit)."""

    avx512_core: float = Field(1.0, ge=0, description="AVX512 and latency-sensitive work on one physical core")
    avx512_package: float = Field(0.25, ge=0, description="the same within one package (shared power budget)")
    memory_bandwidth: float = Field(4.0, ge=0, description="per capacity of bandwidth demand beyond a NUMA/L3 domain")
    cache_occupancy: float = Field(2.0, ge=0, description="per L3 size of occupancy beyond the pressure threshold")
    latency_critical: float = Field(1.0, ge=0,
                                    description="per CPU of latency-critical work off SST-BF high-priority cores")
    oversubscription: float = Field(2.0, ge=0, description="per CPU of demand beyond a CPU's capacity")


class MigrationCostConfig(_Strict):
    disruption: float = Field(1.0, ge=0, description="fixed cost of any move")
    rewarm: float = Field(1.0, ge=0, description="per CPU-second spent re-warming the cache (occupancy / bandwidth)")
    rewarm_bandwidth_floor_bytes_per_second: float = Field(1e9, gt=0)
    remote_memory: float = Field(0.1, ge=0, description="per GB/s made remote, per unit of NUMA distance increase")
    remote_memory_seconds: float = Field(30.0, ge=0, description="how long memory stays behind after a NUMA change")


class RebalancerOverride(_Strict):
    """Signals or metadata for matching containers, ahead of (or instead of) collectors and the relay."""

    match: dict[str, str] = Field(min_length=1, description="container labels that must all equal, e.g. {container: x}")
    avx512_ratio: float | None = Field(None, ge=0, le=1)
    latency_critical: bool | None = None
    cpu_request: float | None = Field(None, ge=0)
    exclusive: bool | None = None
    memory_bandwidth_bytes_per_second: float | None = Field(None, ge=0)
    llc_occupancy_bytes: float | None = Field(None, ge=0)
    llc_misses_per_second: float | None = Field(None, ge=0)


class RebalancerConfig(_Strict):
    enabled: bool = True
    mode: Literal["off", "advise", "enforce"] = Field("advise", description="advise: plans visible, nothing applied")
    interval_seconds: float = Field(30.0, ge=MIN_INTERVAL_SECONDS, le=MAX_INTERVAL_SECONDS)
    window_seconds: float = Field(60.0, gt=0, description="recent window of the store the model reads")
    amortization_seconds: float = Field(60.0, gt=0, description="a move pays if gain/s x this > migration cost")
    max_moves_per_round: int = Field(4, ge=0)
    cooldown_seconds: float = Field(300.0, ge=0, description="a moved container stays put this long")
    min_net_gain: float = Field(1.0, ge=0, description="hysteresis: smallest net gain worth a move")
    gain_margin: float = Field(0.2, ge=0, description="hysteresis: gain must beat migration cost x (1 + margin)")
    move_exclusive: bool = Field(False, description="also move exclusive (Guaranteed, pinned) containers")
    reserved_cpus: str = Field("", description="cpu list never given to moved containers")
    namespaces: list[str] = Field(default_factory=list, description="only these namespaces; empty means all")
    avx512_threshold: float = Field(0.1, ge=0, le=1, description="AVX512 ratio from which a container counts as AVX512")
    besteffort_sensitivity: float = Field(0.5, ge=0)
    latency_critical_factor: float = Field(2.0, ge=1)
    oversubscription_threshold: float = Field(1.0, gt=0, description="CPU load above which demand is oversubscribed")
    cache_pressure_threshold: float = Field(0.9, gt=0, description="L3 occupancy fraction where pressure starts")
    numa_bandwidth_bytes_per_second: float = Field(100e9, gt=0, description="memory bandwidth of one NUMA node")
    l3_bandwidth_bytes_per_second: float | None = Field(None, gt=0, description="per L3 domain; unset: no limit")
    applier: Literal["auto", "relay", "cgroup"] = Field("auto", description="auto: the relay's move API if present")
    history_size: int = Field(100, ge=1)
    skip_threshold: float = Field(
        0.1, ge=0, description="skip a round's planning while no input moved by more than this fraction (of its "
        "value at the last planned round, or of a floor per signal: 1 CPU, 8 MiB, 1 GB/s, 1e6 misses/s); 0: plan "
        "every round")
    max_skip_seconds: float = Field(300.0, ge=0, description="plan at least this often, whatever changed")
    weights: RebalancerWeights = Field(default_factory=RebalancerWeights)
    migration: MigrationCostConfig = Field(default_factory=MigrationCostConfig)
    overrides: list[RebalancerOverride] = Field(default_factory=list)

    @field_validator("reserved_cpus")
    @classmethod
    def _check_cpulist(cls, v: str) -> str:
        from .sysfs import parse_cpulist

        parse_cpulist(v)  # ValueError names the bad element
        return v


def redact_url(url: str) -> str:
    """``scheme://user:password@host/...`` with the user information replaced: for the API, logs and errors."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url
    return f"{scheme}://<redacted>@{authority.rpartition('@')[2]}{slash}{path}"


class RemoteWriteBasicAuth(_Strict):
    username: str = Field(min_length=1)
    password: SecretStr | None = Field(None, description="the password (a secret; prefer password_file)")
    password_file: Path | None = Field(None, description="file holding the password")

    @model_validator(mode="after")
    def _one_password(self) -> RemoteWriteBasicAuth:
        if (self.password is None) == (self.password_file is None):
            raise ValueError("set exactly one of password and password_file")
        return self


class RemoteWriteConfig(_Strict):
    """Prometheus remote-write 1.0 of the store's samples (docs/remote_write.md)."""

    url: str = Field(description="receiver, e.g. http://prometheus:9090/api/v1/write")
    interval_seconds: float = Field(15.0, ge=MIN_INTERVAL_SECONDS, le=MAX_INTERVAL_SECONDS,
                                    description="how often new samples are read from the store and sent")
    queue_max: int = Field(100_000, ge=1, le=10_000_000,
                           description="samples held while the receiver is unreachable; oldest dropped")
    batch_max: int = Field(5000, ge=1, le=100_000, description="samples per request")
    timeout_seconds: float = Field(10.0, gt=0)
    min_backoff_seconds: float = Field(0.5, ge=0.01, description="first retry delay; doubles up to max_backoff_seconds")
    max_backoff_seconds: float = Field(30.0, gt=0)
    external_labels: dict[str, str] = Field(default_factory=dict,
                                            description="added to every series; 'node' defaults to node_name")
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, description="extra HTTP headers, e.g. X-Scope-OrgID for Mimir (values are secrets)")
    basic_auth: RemoteWriteBasicAuth | None = Field(None, description="HTTP basic authentication of the receiver")
    bearer_token_file: Path | None = Field(None, description="file holding a bearer token for Authorization")
    tls_ca_file: Path | None = Field(None, description="CA bundle for an https receiver")
    metric_regex: str = Field(".+", description="only metrics whose name fully matches this regular expression")
    self_metrics: bool = Field(True, description="also send the agent's own metrics (collector health, remote_write)")

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {redact_url(v)!r}")
        return v

    @field_serializer("url")
    def _show_url(self, v: str) -> str:
        return redact_url(v)  # user:password@ is a secret; the rest of the URL is not

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for k, v in super().__repr_args__():
            yield k, (redact_url(v) if k == "url" else v)

    @field_validator("metric_regex")
    @classmethod
    def _check_regex(cls, v: str) -> str:
        import re

        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return v

    @field_validator("max_backoff_seconds")
    @classmethod
    def _check_backoff(cls, v: float, info) -> float:
        lo = info.data.get("min_backoff_seconds")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= min_backoff_seconds ({lo})")
        return v


class ExportConfig(_Strict):
    remote_write: RemoteWriteConfig | None = Field(None, description="unset: no remote write")


class RelayConfig(_Strict):
    """The CRI relay (``cri-resmgr relay``, a process of its own; docs/relay.md)."""

    socket: Path = Field(Path("/var/run/cri-resmgr/cri-resmgr.sock"),
                         description="where kubelet connects (--container-runtime-endpoint)")
    runtime_socket: Path = Field(Path("/run/containerd/containerd.sock"), description="the runtime's CRI socket")
    image_socket: Path | None = Field(None, description="a separate image service socket of the runtime, if any")
    image_relay_socket: Path | None = Field(
        None, description="with image_socket: where kubelet's --image-service-endpoint connects")
    control_socket: Path | None = Field(None, description="move/cache/metrics API; default run_dir/relay-control.sock")
    allow_untested_runtimes: bool = Field(False, description="forward to runtimes other than containerd and CRI-O")
    runtime_timeout_seconds: float = Field(10.0, gt=0, description="timeout of the relay's own calls to the runtime")
    event_loop_nice: int = Field(-10, ge=-20, le=19,
                                 description="nice of the thread that forwards every call: woken by a call it "
                                             "preempts ordinary (nice 0) work instead of queueing behind it "
                                             "(needs CAP_SYS_NICE; docs/relay.md)")
    reconcile_interval_seconds: float = Field(5.0, gt=0,
                                              description="how often the cache is checked against the runtime")
    reserved_cpus: str = Field("", description="cpulist kept for the system: never exclusive, not in the shared pool")
    reserved_namespaces: list[str] = Field(default_factory=lambda: ["kube-system"],
                                           description="pods here run on reserved_cpus (when set)")
    min_shared_cpus: int = Field(1, ge=0, description="CPUs the shared pool keeps whatever is exclusive")
    allow_move_exclusive: bool = Field(False, description="let the move API move exclusively placed containers")
    dump_file: Path | None = Field(None, description="JSON lines of every CRI message (debugging; off when unset)")
    metrics_listen: str | None = Field(None, description="HOST:PORT serving the relay's /metrics (off when unset)")

    @field_validator("reserved_cpus")
    @classmethod
    def _check_cpus(cls, v: str) -> str:
        from .sysfs import parse_cpulist

        parse_cpulist(v)
        return v

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, v: str | None) -> str | None:
        if v is not None:
            parse_listen(v)
        return v

    @model_validator(mode="after")
    def _check_image_sockets(self) -> RelayConfig:
        if (self.image_socket is None) != (self.image_relay_socket is None):
            raise ValueError("image_socket and image_relay_socket go together: the relay serves the runtime's "
                             "image socket on a listener of its own")
        return self


class NriConfig(_Strict):
    """The NRI plugin (``cri-resmgr nri``, a process of its own; docs/nri.md). Placement settings
    (reserved_cpus, reserved_namespaces, min_shared_cpus, allow_move_exclusive) are the ``relay.*`` keys:
    one placement engine behind both front ends."""

    socket: Path = Field(Path("/var/run/nri/nri.sock"), description="the runtime's NRI socket")
    plugin_name: str = Field("cri-resmgr", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                             description="name the plugin registers under")
    plugin_index: str = Field("90", pattern=r"^[0-9]{2}$",
                              description="two digits: the plugin's place in the runtime's plugin order")
    control_socket: Path | None = Field(
        None, description="move/state/metrics API (the relay's interface); default run_dir/relay-control.sock")
    request_timeout_seconds: float = Field(
        1.5, gt=0, description="answer each runtime request within this or let it through unchanged "
                               "(keep below the runtime's plugin_request_timeout, 2 s in containerd)")
    reconnect_max_seconds: float = Field(5.0, gt=0, description="longest wait between reconnection attempts")


QosClassName = Literal["Guaranteed", "Burstable", "BestEffort"]


class _ControlSection(_Strict):
    """What every resource control shares (docs/resource-control.md): classes, and the class a container gets
    from its QoS class when no annotation names one."""

    enabled: bool = True
    defaults: dict[QosClassName, str] = Field(default_factory=dict, description="QoS class -> class name")

    def class_names(self) -> list[str]:
        raise NotImplementedError

    @model_validator(mode="after")
    def _check_defaults(self) -> _ControlSection:
        known = set(self.class_names())
        for qos, name in self.defaults.items():
            if name not in known:
                names = ", ".join(sorted(known)) or "none"
                raise ValueError(f"defaults.{qos}: unknown class {name!r} (classes: {names})")
        return self


class BlockioDeviceRule(_Strict):
    """Limits for the block devices a pattern names (glob under paths.dev, e.g. /dev/vd*)."""

    devices: str = Field(min_length=1, description="device path pattern, e.g. /dev/vd*")
    weight: int | None = Field(None, ge=1, le=10000, description="per-device proportional weight")
    read_bps: int | None = Field(None, ge=1, description="bytes/s")
    write_bps: int | None = Field(None, ge=1, description="bytes/s")
    read_iops: int | None = Field(None, ge=1)
    write_iops: int | None = Field(None, ge=1)


class BlockioClass(_Strict):
    weight: int | None = Field(None, ge=1, le=10000, description="default weight (v1 BFQ 1-1000, v2 io.weight 1-10000)")
    devices: list[BlockioDeviceRule] = Field(default_factory=list)


class BlockioControlConfig(_ControlSection):
    """Block-IO classes on cgroup v1 blkio or v2 io (docs/resource-control.md)."""

    classes: dict[str, BlockioClass] = Field(default_factory=dict)

    def class_names(self) -> list[str]:
        return list(self.classes)


class RtClass(_Strict):
    runtime_us: int = Field(ge=1, description="cpu.rt_runtime_us granted to the container per cpu.rt_period_us")


class RtControlConfig(_ControlSection):
    """Real-time groups on cgroup v1 cpu.rt_runtime_us (docs/resource-control.md)."""

    classes: dict[str, RtClass] = Field(default_factory=dict)

    def class_names(self) -> list[str]:
        return list(self.classes)


RdtAmount = str | dict[str, str]  # one amount for every cache id, or per cache id with 'all' as the default


class RdtClass(_Strict):
    l3: RdtAmount | None = Field(None, description="share of the partition: 50%, 20-60%, 0xf0, 4-7, 2MiB")
    l3_code: RdtAmount | None = Field(None, description="CDP code share (L3CODE); l3 when unset")
    l3_data: RdtAmount | None = Field(None, description="CDP data share (L3DATA); l3 when unset")
    mb: RdtAmount | None = Field(None, description="memory bandwidth: 50% or, with mba_MBps, 2000MBps")
    required: list[Literal["l3", "mb", "cdp"]] = Field(
        default_factory=list, description="features this class cannot do without (others degrade)")


class RdtPartition(_Strict):
    l3: RdtAmount = Field("100%", description="share of the whole cache; partitions never overlap")
    classes: dict[str, RdtClass] = Field(default_factory=dict)


class RdtControlConfig(_ControlSection):
    """RDT allocation classes on resctrl (docs/resource-control.md)."""

    l3: Literal["auto", "on", "off"] = Field("auto", description="L3 cache allocation")
    mb: Literal["auto", "on", "off"] = Field("auto", description="memory bandwidth allocation")
    cdp: Literal["auto", "on", "off"] = Field("auto", description="code/data prioritisation (resctrl -o cdp)")
    l3_cache_bytes: int | None = Field(None, ge=1, description="L3 size for kiB/MiB amounts; default from sysfs")
    partitions: dict[str, RdtPartition] = Field(default_factory=dict)

    def class_names(self) -> list[str]:
        return [c for p in self.partitions.values() for c in p.classes]

    @model_validator(mode="after")
    def _check_partitions(self) -> RdtControlConfig:
        from .placement.controllers.schemata import check_partitions

        problems = check_partitions(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ControlsConfig(_Strict):
    """Resource controls the placement engine enforces per container class (docs/resource-control.md)."""

    rdt: RdtControlConfig = Field(default_factory=RdtControlConfig)
    blockio: BlockioControlConfig = Field(default_factory=BlockioControlConfig)
    rt: RtControlConfig = Field(default_factory=RtControlConfig)


class ApiConfig(_Strict):
    token: SecretStr | None = Field(
        None, description="bearer token required by mutating endpoints; none means they are disabled"
    )
    read_token: SecretStr | None = Field(
        None, description="bearer token required by every endpoint but /healthz, /readyz and the UI's static files "
                          "(token works too)"
    )
    allow_unauthenticated_reads: bool = Field(
        False, description="serve reads without read_token on a non-loopback listen address (a decision, not a default)"
    )
    allowed_hosts: list[str] = Field(
        default_factory=list, description="Host header names accepted on a loopback listen besides the loopback ones"
    )
    max_concurrent_queries: int = Field(
        2, ge=1, le=64, description="heavy requests (queries, heatmaps, series) served at once; more answer 429"
    )


class Config(_Strict):
    listen: str = Field("127.0.0.1:8891", description="HOST:PORT of the HTTP server")
    node_name: str | None = Field(None, description="defaults to $NODE_NAME, then the hostname")
    run_dir: Path = Path("/var/run/cri-resmgr")
    state_dir: Path = Path("/var/lib/cri-resmgr")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    paths: Paths = Field(default_factory=Paths)
    store: StoreConfig = Field(default_factory=StoreConfig)
    collectors: Collectors = Field(default_factory=Collectors)
    api: ApiConfig = Field(default_factory=ApiConfig)
    rebalancer: RebalancerConfig = Field(default_factory=RebalancerConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    relay: RelayConfig = Field(default_factory=RelayConfig)
    nri: NriConfig = Field(default_factory=NriConfig)
    controls: ControlsConfig = Field(default_factory=ControlsConfig)
    series: SeriesConfig = Field(default_factory=SeriesConfig)

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        parse_listen(v)
        return v

    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)

    def exposure_problems(self) -> list[str]:
        """Serving reads beyond this node without a token must be a decision: ``key: problem`` lines."""
        host, _ = self.listen_address()
        if is_loopback_host(host) or self.api.read_token is not None or self.api.allow_unauthenticated_reads:
            return []
        return [f"api.read_token: required when listen ({self.listen}) is not a loopback address; set it (the "
                f"token Prometheus scrapes with), listen on a loopback or node-local address, or set "
                f"api.allow_unauthenticated_reads: true"]


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP address (127.0.0.0/8, ::1)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_listen(v: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:8891`` for IPv6) and check the port range."""
    host, sep, port = v.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {v!r}")
    host = host.strip("[]")
    try:
        port_n = int(port)
    except ValueError:
        raise ValueError(f"port {port!r} is not a number") from None
    if not 0 <= port_n <= 65535:
        raise ValueError(f"port {port_n} is outside 0..65535")
    return host, port_n


def default_node_name(env: Mapping[str, str]) -> str:
    return env.get("NODE_NAME") or socket.gethostname()


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# Keys whose values are secrets (or may hold one): never echoed in error texts.
SECRET_KEYS = frozenset({"token", "read_token", "headers", "basic_auth", "password", "url"})


def _format_errors(err: ValidationError, prefix: str = "") -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif "input" in e and not isinstance(e["input"], (dict, list)) and not SECRET_KEYS.intersection(
                str(p) for p in e["loc"]):
            msg = f"{msg} (got {e['input']!r})"
        problems.append(f"{prefix}{loc}: {msg}")
    return problems


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``CRI_RESMGR_A__B=v`` becomes ``{"a": {"b": v}}``; values are YAML scalars."""
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        keys = [k.lower() for k in name[len(ENV_PREFIX):].split("__") if k]
        if not keys:
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, (dict, list)):
            value = raw  # a structure in an env var is more likely a string with a colon
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError([f"{'.'.join(keys)}: conflicts with {name}"], source="environment")
        node[keys[-1]] = value
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError([f"cannot read: {e.strerror}"], source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError([f"{where}not valid YAML: {getattr(e, 'problem', e)}"], source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"<root>: expected a mapping of keys, got {type(data).__name__}"], source=str(path))
    return data


def build_config(
    file_data: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    source: str = "config",
) -> Config:
    """Merge all sources and validate. Raises :class:`ConfigError`."""
    env = os.environ if env is None else env
    data = dict(file_data or {})
    overrides = data.pop("node_overrides", None) or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(["node_overrides: expected a mapping of node name to options"], source=source)

    try:
        base = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e), source=source) from None

    # Check every node's overrides, not just this node's: a broken entry for another node
    # would otherwise only surface when the DaemonSet lands there.
    problems: list[str] = []
    for node, over in overrides.items():
        if not isinstance(over, Mapping):
            problems.append(f"node_overrides.{node}: expected a mapping of options")
            continue
        if "node_overrides" in over:
            problems.append(f"node_overrides.{node}.node_overrides: cannot be nested")
            continue
        try:
            Config.model_validate(_deep_merge(data, over))
        except ValidationError as e:
            problems += _format_errors(e, prefix=f"node_overrides.{node}.")
    if problems:
        raise ConfigError(problems, source=source)

    node_name = base.node_name or default_node_name(env)
    merged = dict(data)
    if node_name in overrides:
        merged = _deep_merge(merged, overrides[node_name])
    try:
        merged = _deep_merge(merged, env_overrides(env))
        Config.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_errors(e), source="environment") from None
    merged = _deep_merge(merged, {k: v for k, v in (flags or {}).items() if v is not None})
    try:
        cfg = Config.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_errors(e), source="command line") from None
    if cfg.exposure_problems():
        raise ConfigError(cfg.exposure_problems(), source=source)
    return cfg.model_copy(update={"node_name": cfg.node_name or node_name})


def load_config(
    path: Path | None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    file_data = read_config_file(path) if path else {}
    return build_config(file_data, env=env, flags=flags, source=str(path) if path else "config")
