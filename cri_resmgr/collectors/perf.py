"""Per-container hardware counters (cycles, instructions, LLC references and misses) from perf_event.

One event group per (container cgroup, CPU), opened in cgroup mode (perf_event_open(2),
``PERF_FLAG_PID_CGROUP``). Which hierarchy carries the perf_event controller depends on the host:

- pure cgroup v2: the v2 tree itself;
- cgroup v1 with a perf_event hierarchy mounted (``<cgroup root>/perf_event``, or a comma-joined name
  such as ``perf_event,net_cls``): that hierarchy, where the kubelet/runc create the container's cgroup;
- hybrid v1 + ``unified`` without a v1 perf_event mount: the v2 ``unified`` tree, because "perf_event
  controller, if not mounted on a legacy hierarchy, is automatically enabled on the v2 hierarchy so that
  perf events can always be filtered by cgroup v2 path" (Documentation/admin-guide/cgroup-v2.rst,
  "Controllers" / perf_event). runc joins the unified tree too on hybrid hosts.

Counts are scaled for multiplexing (``value * time_enabled / time_running``) and summed over CPUs.
Descriptors are bounded by ``max_descriptors``: priority containers first (``priority`` selectors and,
by default, the configured extra cgroups), then the busiest by CPU usage; the rest are reported as
skipped (``cri_resmgr_container_perf_monitored{reason}`` = 0 and the collector's reason).
Unsupported events (ENOENT/EOPNOTSUPP/EINVAL from the kernel) are reported by name; the others go on.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import metrics as M
from ..config import PerfCollectorConfig
from ..store import Sample
from ..sysfs import parse_flat_keyed, read_int, read_text
from ..topology import Topology
from . import perf_event as pe
from .base import Collector, CollectorUnavailable, Probe
from .cgroup import CgroupCollector, CgroupLayout, OpenFiles, _Gone, _paths, detect_layout
from .identity import ContainerIdentity, short_name
from .perfmon import EventResolveError, EventSpec, load_perfmon, resolve

log = logging.getLogger(__name__)

# Descriptors kept free for everything else the agent opens (sockets, files, BPF objects).
FD_RESERVE = 256

_METRIC_OF_KEY = {
    "cycles": M.CONTAINER_CYCLES,
    "instructions": M.CONTAINER_INSTRUCTIONS,
    "llc_references": M.CONTAINER_LLC_REFERENCES,
    "llc_misses": M.CONTAINER_LLC_MISSES,
    "cpu_clock": M.CONTAINER_PERF_CPU_CLOCK,
    "context_switches": M.CONTAINER_PERF_CONTEXT_SWITCHES,
    "page_faults": M.CONTAINER_PAGE_FAULTS,
}
# cpu-clock counts nanoseconds; the metric is in seconds.
_UNIT_SCALE = {"cpu_clock": 1e-9}


@dataclass(frozen=True)
class PerfCgroupRoot:
    path: Path
    kind: str  # "cgroup v2", "cgroup v1 perf_event", "cgroup v2 (unified, hybrid host)"


def find_perf_cgroup_root(cgroup_root: Path) -> PerfCgroupRoot | None:
    """Where container cgroups must be opened for perf cgroup mode (see the module docstring)."""
    root = Path(cgroup_root)
    if (root / "cgroup.controllers").exists():
        return PerfCgroupRoot(root, "cgroup v2")
    try:
        names = sorted(e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=True))
    except OSError:
        return None
    for n in names:
        if "perf_event" in n.split(",") and (root / n / "cgroup.procs").exists():
            return PerfCgroupRoot(root / n, "cgroup v1 perf_event")
    if (root / "unified" / "cgroup.controllers").exists():
        return PerfCgroupRoot(root / "unified", "cgroup v2 (unified, hybrid host)")
    return None


def read_cpu_usage_seconds(layout: CgroupLayout, rel: str) -> float | None:
    """CPU usage of one cgroup (cgroup-v2.rst ``cpu.stat usage_usec``; cgroup-v1/cpuacct.rst ``cpuacct.usage`` ns)."""
    rel = rel.strip("/")
    if layout.version == 2:
        v = parse_flat_keyed(read_text(layout.root / rel / "cpu.stat") or "").get("usage_usec")
        return v / 1e6 if v is not None else None
    ns = read_int(layout.root / rel / "cpuacct.usage")
    return ns / 1e9 if ns is not None else None


def is_extra_cgroup(ident: ContainerIdentity) -> bool:
    return ident.runtime == "" and ident.pod_uid == ""


def matches(sel, ident: ContainerIdentity) -> bool:
    return all(fnmatch.fnmatchcase(v, pat) for v, pat in (
        (ident.namespace, sel.namespace), (ident.pod, sel.pod), (ident.name, sel.container),
        (ident.container_id, sel.container_id)))


@dataclass
class CpuGroup:
    cpu: int
    fds: list[int]  # leader first
    index_of_id: dict[int, int]  # kernel event id -> index into PerfCollector.events
    last: dict[int, float] = field(default_factory=dict)  # index -> last scaled count (kept monotonic)
    times_ns: tuple[int, int] = (0, 0)  # the leader's last (time_enabled, time_running)


@dataclass
class Watched:
    ident: ContainerIdentity
    groups: dict[int, CpuGroup] = field(default_factory=dict)
    retired: dict[int, float] = field(default_factory=dict)  # counts of CPU groups closed on a cpuset change
    prev_totals: dict[int, float] | None = None
    retired_times_ns: tuple[int, int] = (0, 0)  # enabled/running of CPU groups closed on a cpuset change
    series: dict[int, tuple[str, dict[str, str], float]] = field(default_factory=dict)  # event -> its series
    _labels: dict[str, dict[str, str]] = field(default_factory=dict)
    usage_file: OpenFiles = field(default_factory=OpenFiles)  # the container's CPU usage file, kept open
    usage: bytes | None = None  # its text when the groups were last read
    read_at: float = 0.0  # and when
    idle_runs: int = 0  # runs since, the groups not read (the container did not run)
    times_ns: tuple[int, int] = (0, 0)  # enabled/running summed at that read

    def labels(self, reason: str | None = None) -> dict[str, str]:
        """The container's labels (with an empty ``reason`` for perf_monitored), built once."""
        key = "" if reason is None else reason
        lab = self._labels.get(key)
        if lab is None:
            lab = self._labels[key] = self.ident.labels() if reason is None else {**self.ident.labels(), reason: ""}
        return lab

    @property
    def fds(self) -> int:
        return sum(len(g.fds) for g in self.groups.values())


class _NoPerfCgroup(Exception):
    pass


class _OutOfDescriptors(Exception):
    pass


@dataclass(frozen=True)
class Skipped:
    ident: ContainerIdentity
    reason: str  # budget | no_perf_cgroup | descriptor_limit | open_failed | no_cpus


def plan_selection(ranked: list[tuple[ContainerIdentity, bool, int]], watched: set[str], budget: int,
                   full: bool) -> tuple[list[ContainerIdentity], list[ContainerIdentity]]:
    """Choose containers within ``budget`` descriptors.

    ``ranked`` is ``(identity, priority, cost)`` best first. On a full reselection the list is taken
    greedily in rank order (a container that does not fit is skipped and smaller ones after it may
    still fit). Between reselections the ones already watched keep their place, newcomers fill what is
    left, and a priority newcomer may evict the lowest-ranked non-priority container.
    Returns ``(chosen, skipped)``, both in rank order.
    """
    chosen: list[tuple[ContainerIdentity, bool, int]] = []
    used = 0
    if full:
        for item in ranked:
            if used + item[2] <= budget:
                chosen.append(item)
                used += item[2]
    else:
        chosen = [it for it in ranked if it[0].container_id in watched]
        used = sum(it[2] for it in chosen)
        for item in ranked:
            if item[0].container_id in watched:
                continue
            ident, prio, cost = item
            while prio and used + cost > budget:
                victims = [c for c in chosen if not c[1]]
                if not victims:
                    break
                victim = victims[-1]
                chosen.remove(victim)
                used -= victim[2]
            if used + cost <= budget:
                chosen.append(item)
                used += cost
        order = {it[0].container_id: i for i, it in enumerate(ranked)}
        chosen.sort(key=lambda it: order[it[0].container_id])
    ids = {it[0].container_id for it in chosen}
    return [it[0] for it in chosen], [it[0] for it in ranked if it[0].container_id not in ids]


class PerfCollector(Collector):
    name = "perf"

    def __init__(self, cgroup_root: Path, cfg: PerfCollectorConfig | None = None,
                 discovery: CgroupCollector | None = None, topology: Topology | None = None,
                 clock=time.monotonic):
        self.cgroup_root = Path(cgroup_root)
        self.cfg = cfg or PerfCollectorConfig()
        self.discovery = discovery or CgroupCollector(self.cgroup_root)
        self.topology = topology or Topology()
        self.clock = clock
        self.watched: dict[str, Watched] = {}
        self.skipped: dict[str, Skipped] = {}
        self.unsupported: dict[str, str] = {}  # event name -> why
        self.events: list[EventSpec] = []
        self.bad_cpus: set[int] = set()
        self._attrs: list[pe.PerfEventAttr] = []
        self._events_probed = False
        self._last_reselect: float | None = None
        self._usage: dict[str, tuple[float, float]] = {}  # container id -> (t, usage seconds)
        self._rate: dict[str, float] = {}
        self._budget: int | None = None
        self._root: PerfCgroupRoot | None = None
        self._lock = threading.Lock()
        self._resolve_events()

    # -- configuration -----------------------------------------------------------------------------
    def _resolve_events(self) -> None:
        perfmon = None
        self.unsupported = {}
        if self.cfg.perfmon_path is not None:
            try:
                perfmon = load_perfmon(self.cfg.perfmon_path)
            except EventResolveError as e:
                perfmon = {}
                log.warning("%s", e)
                self.unsupported["<perfmon_path>"] = str(e)
        events = []
        for s in self.cfg.events:
            try:
                events.append(resolve(s, perfmon))
            except EventResolveError as e:
                self.unsupported[s] = str(e)
        self.events = events
        self._attrs = [pe.make_attr(ev.type, ev.config, ev.config1, ev.config2) for ev in events]
        self._events_probed = False

    def reconfigure(self, cfg: PerfCollectorConfig) -> None:
        """Apply a reloaded configuration (called from the reload thread, hence the lock)."""
        with self._lock:
            if cfg == self.cfg:
                return
            events_changed = (cfg.events, cfg.perfmon_path) != (self.cfg.events, self.cfg.perfmon_path)
            self.cfg = cfg
            self._budget = None
            if events_changed or not cfg.enabled:
                self._close()
            if events_changed:
                self._resolve_events()
            self._last_reselect = None

    @property
    def supported_events(self) -> list[int]:
        return [i for i, ev in enumerate(self.events) if ev.name not in self.unsupported]

    def cpus(self) -> list[int]:
        online = sorted(self.topology.online) or list(range(os.cpu_count() or 1))
        return [c for c in online if c not in self.bad_cpus]

    def budget(self) -> int:
        """``max_descriptors``, lowered to what RLIMIT_NOFILE leaves after FD_RESERVE (raised to the hard
        limit first when that helps)."""
        if self._budget is None:
            want = self.cfg.max_descriptors + FD_RESERVE
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if soft != resource.RLIM_INFINITY and soft < want:
                new = want if hard == resource.RLIM_INFINITY else min(want, hard)
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                    soft = new
                except (ValueError, OSError) as e:
                    log.warning("cannot raise RLIMIT_NOFILE to %d: %s", new, e)
            limit = self.cfg.max_descriptors if soft == resource.RLIM_INFINITY else soft - FD_RESERVE
            self._budget = max(0, min(self.cfg.max_descriptors, limit))
        return self._budget

    # -- probe -------------------------------------------------------------------------------------
    def probe(self) -> Probe:
        root = find_perf_cgroup_root(self.cgroup_root)
        if root is None:
            return Probe(False, f"no hierarchy with the perf_event controller under {self.cgroup_root} "
                                "(neither cgroup v2, a v1 perf_event mount, nor a unified tree)")
        return Probe(True, self.summary(root))

    def status(self) -> str | None:
        return self.summary()

    def summary(self, root: PerfCgroupRoot | None = None) -> str:
        root = root or self._root
        parts = [f"cgroup mode on {root.kind} ({root.path})" if root else "cgroup mode"]
        fds = sum(w.fds for w in self.watched.values())
        parts.append(f"watching {len(self.watched)} containers with {fds} descriptors (budget {self.budget()})")
        if self.skipped:
            names = [short_name(s.ident) + f" ({s.reason})" for s in list(self.skipped.values())[:5]]
            more = f" and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
            parts.append(f"skipped {len(self.skipped)}: {', '.join(names)}{more}")
        if self.unsupported:
            parts.append("unsupported events: " + "; ".join(f"{k} ({v})" for k, v in self.unsupported.items()))
        return "; ".join(parts)

    def _probe_events(self, root: PerfCgroupRoot) -> None:
        """Open each event once, alone, on the hierarchy's root cgroup to learn which the kernel supports
        before spending the budget on them."""
        try:
            fd = os.open(root.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise CollectorUnavailable(f"cannot open {root.path}: {e.strerror}") from None
        try:
            cpu = (self.cpus() or [0])[0]
            for ev in self.events:
                if ev.name in self.unsupported:
                    continue
                attr = pe.make_attr(ev.type, ev.config, ev.config1, ev.config2, group_read=False)
                try:
                    os.close(pe.open_cgroup_event(attr, fd, cpu))
                except pe.PerfOpenError as e:
                    if e.errno in (errno.EACCES, errno.EPERM):
                        raise CollectorUnavailable(
                            f"perf_event_open not permitted ({errno.errorcode[e.errno]}): needs CAP_PERFMON or "
                            "root for CPU-wide cgroup events (kernel.perf_event_paranoid)") from None
                    if e.errno in pe.DESCRIPTOR_ERRNOS:
                        raise
                    self.unsupported[ev.name] = _errtext(e)
        finally:
            os.close(fd)
        self._events_probed = True
        for name, why in self.unsupported.items():
            log.warning("perf event %s is not supported here: %s", name, why)

    # -- opening -----------------------------------------------------------------------------------
    def _open_group(self, cgfd: int, cpu: int) -> CpuGroup | None:
        fds: list[int] = []
        ids: dict[int, int] = {}
        try:
            for i in self.supported_events:
                try:
                    fd = pe.open_cgroup_event(self._attrs[i], cgfd, cpu, fds[0] if fds else -1)
                except pe.PerfOpenError as e:
                    if e.errno in pe.DESCRIPTOR_ERRNOS:
                        raise _OutOfDescriptors(_errtext(e)) from None
                    if e.errno == errno.EBADF:
                        raise _NoPerfCgroup() from None
                    if e.errno == errno.ENODEV and not fds:
                        self.bad_cpus.add(cpu)  # offline, or not a CPU this PMU covers
                        return None
                    why = _errtext(e) + (f" (as member {len(fds) + 1} of a group)" if fds else "")
                    self.unsupported[self.events[i].name] = why
                    log.warning("perf event %s failed: %s", self.events[i].name, why)
                    continue
                fds.append(fd)
                ids[pe.event_id(fd)] = i
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if not fds:
            return None
        return CpuGroup(cpu, fds, ids)

    def _target_cpus(self, ident: ContainerIdentity) -> list[int]:
        cpus = self.cpus()
        if self.cfg.cpuset_only:
            info = self.discovery.containers.get(ident.container_id)
            cs = info.stats.cpuset if info else None
            if cs:
                narrowed = [c for c in cpus if c in cs]
                if narrowed:
                    return narrowed
        return cpus

    def _sync_groups(self, root: PerfCgroupRoot, w: Watched, cpus: list[int]) -> None:
        want = set(cpus)
        if set(w.groups) != want:
            w.usage = None  # groups change: read them this run
        for cpu in [c for c in w.groups if c not in want]:
            g = w.groups.pop(cpu)
            for i, v in g.last.items():
                w.retired[i] = w.retired.get(i, 0.0) + v
            w.retired_times_ns = (w.retired_times_ns[0] + g.times_ns[0], w.retired_times_ns[1] + g.times_ns[1])
            _close_group(g)
        missing = [c for c in cpus if c not in w.groups]
        if not missing:
            return
        try:
            cgfd = os.open(root.path / w.ident.cgroup_path.strip("/"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _NoPerfCgroup() from None
        try:
            for cpu in missing:
                opened = self._open_group(cgfd, cpu)
                if opened is not None:
                    w.groups[cpu] = opened
        finally:
            os.close(cgfd)

    # -- collection --------------------------------------------------------------------------------
    def _rank(self, layout: CgroupLayout, idents: list[ContainerIdentity], now: float, refresh: bool = True):
        per_event = len(self.supported_events)
        ranked = []
        rates: dict[str, float] = {}
        # CPU usage as the cgroup collector read it last (with its time), so the same file is not read twice;
        # only when the ranking is redone (``refresh``) and that reading is not newer than ours is it read here.
        infos = getattr(self.discovery, "containers", {})
        for ident in idents:
            cid = ident.container_id
            inf = infos.get(cid)
            prev = self._usage.get(cid)
            if inf is not None and inf.stats.cpu_usage_seconds is not None and (not prev or inf.last_seen > prev[0]):
                at, u = inf.last_seen, inf.stats.cpu_usage_seconds
            elif refresh or prev is None:
                at, u = now, read_cpu_usage_seconds(layout, ident.cgroup_path)
            else:
                at, u = prev
            if u is not None:
                if prev and at > prev[0] and u >= prev[1]:
                    rates[cid] = (u - prev[1]) / (at - prev[0])
                if not prev or at > prev[0]:
                    self._usage[cid] = (at, u)
            prio = (self.cfg.extra_cgroups_first and is_extra_cgroup(ident)) or any(
                matches(s, ident) for s in self.cfg.priority)
            cost = len(self._target_cpus(ident)) * per_event
            ranked.append((ident, prio, cost, rates.get(cid, self._rate.get(cid, 0.0)), u or 0.0))
        self._rate = {**self._rate, **rates}
        ranked.sort(key=lambda r: (not r[1], -r[3], -r[4], r[0].container_id))
        return [(r[0], r[1], r[2]) for r in ranked]

    def collect(self, now: float) -> list[Sample]:
        with self._lock:
            return self._collect(now)

    def _collect(self, now: float) -> list[Sample]:
        layout = detect_layout(self.cgroup_root)
        root = find_perf_cgroup_root(self.cgroup_root)
        if layout is None or root is None:
            raise CollectorUnavailable(f"no cgroup hierarchy with perf_event under {self.cgroup_root}")
        if root != self._root:
            self._close()
            self._root = root
            self._events_probed = False
        if not self._events_probed:
            self._probe_events(root)
        if not self.supported_events:
            raise CollectorUnavailable("none of the configured perf events is supported here: " + "; ".join(
                f"{k} ({v})" for k, v in self.unsupported.items()))

        mono = self.clock()
        idents = self.discovery.identities(layout)
        live = {i.container_id for i in idents}
        for cid in [c for c in self.watched if c not in live]:
            self._close_watched(self.watched.pop(cid))
        self._usage = {k: v for k, v in self._usage.items() if k in live}
        self._rate = {k: v for k, v in self._rate.items() if k in live}

        full = self._last_reselect is None or mono - self._last_reselect >= self.cfg.reselect_interval_seconds
        ranked = self._rank(layout, idents, now, refresh=full)
        if full:
            self._last_reselect = mono
        budget = self.budget()
        # The cost of a watched container is what it holds; a newcomer's is cpus x supported events.
        held = {cid: w.fds for cid, w in self.watched.items()}
        ranked = [(i, p, held.get(i.container_id, c) or c) for i, p, c in ranked]
        chosen, not_chosen = plan_selection(ranked, set(self.watched), budget, full)

        skipped: dict[str, Skipped] = {i.container_id: Skipped(i, "budget") for i in not_chosen}
        for ident in not_chosen:
            w = self.watched.pop(ident.container_id, None)
            if w:
                self._close_watched(w)
        out_of_fds = False
        for ident in chosen:
            cid = ident.container_id
            if out_of_fds:
                skipped[cid] = Skipped(ident, "descriptor_limit")
                continue
            w = self.watched.get(cid) or Watched(ident)
            if w.ident != ident:  # names arrived from the runtime: new labels
                w.ident, w.series, w._labels, w.usage = ident, {}, {}, None
            try:
                self._sync_groups(root, w, self._target_cpus(ident))
            except _NoPerfCgroup:
                skipped[cid] = Skipped(ident, "no_perf_cgroup")
                self._close_watched(w)
                self.watched.pop(cid, None)
                continue
            except _OutOfDescriptors as e:
                log.warning("perf: out of descriptors opening %s: %s", short_name(ident), e)
                out_of_fds = True
                skipped[cid] = Skipped(ident, "descriptor_limit")
                self._close_watched(w)
                self.watched.pop(cid, None)
                continue
            if not w.groups:
                skipped[cid] = Skipped(ident, "no_cpus")
                self.watched.pop(cid, None)
                continue
            self.watched[cid] = w
        self.skipped = skipped
        if not self.supported_events:
            raise CollectorUnavailable("none of the configured perf events is supported here: " + "; ".join(
                f"{k} ({v})" for k, v in self.unsupported.items()))
        return self._read_all(now, layout)

    def _series_of(self, w: Watched, i: int) -> tuple[str, dict[str, str], float]:
        """Metric name, labels and unit factor of event ``i`` for a watched container (built once)."""
        got = w.series.get(i)
        if got is None:
            ev = self.events[i]
            spec = _METRIC_OF_KEY.get(ev.key, M.CONTAINER_PERF_EVENTS)
            lab = w.labels()
            got = w.series[i] = (spec.name, lab if ev.key else {**lab, "event": ev.name},
                                 _UNIT_SCALE.get(ev.key, 1.0))
        return got

    @property
    def refresh_runs(self) -> int:
        """The groups of a container that did not run are read at least once in this many runs: the cgroup
        collector's ``idle_refresh_seconds`` over this collector's interval (1: every run)."""
        return self.discovery.idle_refresh_runs(self.cfg.interval_seconds)

    def _idle(self, w: Watched, layout: CgroupLayout, now: float, every: int, n: int) -> bool:
        """Whether the container's tasks did not run since its groups were last read (its CPU usage file says
        the same): cgroup events count, and their enabled/running times advance, only while the cgroup runs on
        the CPU (kernel/events/core.c, perf_cgroup_event_time), so its counts stand."""
        try:
            usage = w.usage_file.read(_paths(layout, w.ident.cgroup_path, False)[0])
        except _Gone:
            usage = None
        if (usage is not None and usage == w.usage and w.idle_runs + 1 < every and w.prev_totals is not None
                and now - w.read_at < every * self.cfg.interval_seconds):
            w.idle_runs += 1
            return True
        w.idle_runs = n % every if w.usage is None else 0  # containers watched together refresh in turn
        w.usage, w.read_at = usage, now
        return False

    def _read_all(self, now: float, layout: CgroupLayout) -> list[Sample]:
        samples: list[Sample] = []
        idx_cycles = next((i for i, e in enumerate(self.events) if e.key == "cycles"), None)
        idx_instr = next((i for i, e in enumerate(self.events) if e.key == "instructions"), None)
        every = self.refresh_runs
        for n, w in enumerate(self.watched.values()):
            if every > 1 and self._idle(w, layout, now, every, n):
                totals = w.prev_totals or {}
                lab = w.labels()
                for ev_i, count in totals.items():
                    name, labels, unit = self._series_of(w, ev_i)
                    samples.append(Sample(name, labels, count * unit))
                samples.append(Sample(M.CONTAINER_PERF_MONITORED.name, w.labels("reason"), 1.0))
                samples.append(Sample(M.CONTAINER_PERF_ENABLED.name, lab, w.times_ns[0] / 1e9))
                samples.append(Sample(M.CONTAINER_PERF_RUNNING.name, lab, w.times_ns[1] / 1e9))
                samples.append(Sample(M.CONTAINER_PERF_DESCRIPTORS.name, lab, float(w.fds)))
                continue
            totals = dict(w.retired)
            enabled_ns, running_ns = w.retired_times_ns
            for g in w.groups.values():
                try:
                    r = pe.read_group(g.fds[0], len(g.fds))
                except (OSError, ValueError) as e:
                    log.debug("perf read failed for %s cpu %d: %s", short_name(w.ident), g.cpu, e)
                    enabled_ns += g.times_ns[0]
                    running_ns += g.times_ns[1]
                    continue
                g.times_ns = (max(g.times_ns[0], r.time_enabled_ns), max(g.times_ns[1], r.time_running_ns))
                enabled_ns += g.times_ns[0]
                running_ns += g.times_ns[1]
                for id_, raw in r.values.items():
                    i = g.index_of_id.get(id_)
                    if i is None:
                        continue
                    scaled = pe.scale_count(raw, r.time_enabled_ns, r.time_running_ns)
                    if scaled is not None:
                        # Extrapolation can dip when the multiplexing ratio changes; counters must not.
                        g.last[i] = max(scaled, g.last.get(i, 0.0))
                for i, v in g.last.items():
                    totals[i] = totals.get(i, 0.0) + v
            lab = w.labels()
            for i, v in totals.items():
                name, labels, unit = self._series_of(w, i)
                samples.append(Sample(name, labels, v * unit))
            if idx_cycles is not None and idx_instr is not None and w.prev_totals is not None:
                dc = totals.get(idx_cycles, 0.0) - w.prev_totals.get(idx_cycles, 0.0)
                di = totals.get(idx_instr, 0.0) - w.prev_totals.get(idx_instr, 0.0)
                if di > 0 and dc >= 0:
                    samples.append(Sample(M.CONTAINER_CPI.name, lab, dc / di))
            w.prev_totals = totals
            w.times_ns = (enabled_ns, running_ns)
            samples.append(Sample(M.CONTAINER_PERF_MONITORED.name, w.labels("reason"), 1.0))
            # The multiplexing made visible: counts above are scaled by enabled / running.
            samples.append(Sample(M.CONTAINER_PERF_ENABLED.name, lab, enabled_ns / 1e9))
            samples.append(Sample(M.CONTAINER_PERF_RUNNING.name, lab, running_ns / 1e9))
            samples.append(Sample(M.CONTAINER_PERF_DESCRIPTORS.name, lab, float(w.fds)))
        for s in self.skipped.values():
            samples.append(Sample(M.CONTAINER_PERF_MONITORED.name, {**s.ident.labels(), "reason": s.reason}, 0.0))
        for ev in self.events:
            err = self.unsupported.get(ev.name, "")
            samples.append(Sample(M.PERF_EVENT_SUPPORTED.name, {"event": ev.name, "error": err}, 0.0 if err else 1.0))
        for name in self.cfg.events:
            if name in self.unsupported and not any(ev.name == name for ev in self.events):
                samples.append(Sample(M.PERF_EVENT_SUPPORTED.name, {"event": name, "error": self.unsupported[name]},
                                      0.0))
        samples.append(Sample(M.PERF_DESCRIPTORS.name, {}, float(sum(w.fds for w in self.watched.values()))))
        samples.append(Sample(M.PERF_DESCRIPTOR_BUDGET.name, {}, float(self.budget())))
        samples.append(Sample(M.PERF_CONTAINERS_SKIPPED.name, {}, float(len(self.skipped))))
        return samples

    def _close_watched(self, w: Watched) -> None:
        for g in w.groups.values():
            _close_group(g)
        w.groups.clear()
        w.usage_file.close()
        w.usage = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for w in self.watched.values():
            self._close_watched(w)
        self.watched.clear()
        self.skipped.clear()


def _close_group(g: CpuGroup) -> None:
    for fd in reversed(g.fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    g.fds.clear()


def _errtext(e: OSError) -> str:
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"{code}: {e.strerror}"

