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
import math
import os
import resource
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq, is_, ne
from pathlib import Path

import numpy as np

from .. import metrics as M
from ..config import PerfCollectorConfig
from ..store import Columns, LabelSet, Sample
from ..sysfs import parse_flat_keyed, read_int, read_text
from ..topology import Topology
from . import perf_event as pe
from .base import Collector, CollectorUnavailable, Probe
from .cgroup import CgroupCollector, CgroupLayout, OpenFiles, _ask, _Gone, _paths, _pread_or_none, detect_layout
from .identity import ContainerIdentity, short_name
from .perfmon import EventResolveError, EventSpec, load_perfmon, resolve

log = logging.getLogger(__name__)

# Descriptors kept free for everything else the agent opens (sockets, files, BPF objects).
FD_RESERVE = 256
# The cgroup layout and the hierarchy carrying perf_event change only with a (re)mount: looked up again this
# often, and at once after the collector was closed or found none.
LAYOUT_REFRESH_SECONDS = 30.0

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
    keys: list[tuple[str, Mapping[str, str]]] | None = None  # its series in row slot order (see _ROW_SLOTS), built once
    row: list[float] = field(default_factory=list)  # their values at the last read of its groups (NaN: none)
    _labels: dict[str, Mapping[str, str]] = field(default_factory=dict)
    usage_file: OpenFiles = field(default_factory=OpenFiles)  # the container's CPU usage file, kept open
    usage_path: str = ""  # its path ("" until known for the current cgroup layout)
    usage: bytes | None = None  # its text when the groups were last read
    read_at: float = 0.0  # and when
    read_cycle: int = 0  # and in which run (staggered at the first read, see PerfCollector._fill)
    times_ns: tuple[int, int] = (0, 0)  # enabled/running summed at that read
    n_fds: int = 0  # descriptors held (kept equal to ``fds``)

    def labels(self, reason: str | None = None) -> Mapping[str, str]:
        """The container's labels (with an empty ``reason`` for perf_monitored), built once."""
        key = "" if reason is None else reason
        lab = self._labels.get(key)
        if lab is None:
            lab = self._labels[key] = (self.ident.labels() if reason is None
                                       else LabelSet({**self.ident.labels(), reason: ""}))
        return lab

    @property
    def fds(self) -> int:
        return sum(len(g.fds) for g in self.groups.values())


# A watched container's slots in the collector's row: one per configured event (NaN while it has no count),
# then these.
_CPI, _MONITORED, _ENABLED, _RUNNING, _DESCRIPTORS = range(5)
_ROW_SLOTS = 5


class _NoPerfCgroup(Exception):
    pass


class _OutOfDescriptors(Exception):
    pass


@dataclass(frozen=True)
class Skipped:
    ident: ContainerIdentity
    reason: str  # budget | no_perf_cgroup | descriptor_limit | open_failed | no_cpus


@dataclass
class _Row:
    """The collector's row (:class:`Columns`): every watched container's slots, a 0 for each skipped one, the
    node-level series. The keys list and the values are kept from run to run while the watched and skipped
    containers stay the same; a run writes the slots of the containers whose groups it read."""

    watched: list[Watched]
    skipped: list[Skipped]
    tail_keys: list[tuple[str, Mapping[str, str]]]
    keys: list[tuple[str, Mapping[str, str]]]
    values: np.ndarray
    stride: int  # slots per watched container
    tail_at: int  # where the node-level series start
    cpi: np.ndarray  # the CPI slots (written only in the runs that read the groups)
    read_cycle: np.ndarray  # per watched container: the run of its last read
    read_at: np.ndarray  # and its time
    # The idle check: the CPU usage file of every watched container that has it open, read in one C-level
    # loop; ``pidx[j]`` is the row index of ``pfds[j]``, ``ppos[i]`` the probe position of row index i (-1:
    # none, its file is read on its own).
    pfds: list[int]
    psize: list[int]
    pprev: list[bytes | None]
    pidx: list[int]
    ppos: list[int]
    noprobe: list[int]


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
        self._layout: CgroupLayout | None = None
        self._looked_at = 0.0  # when the layout and the perf_event hierarchy were last looked up
        self._lock = threading.Lock()
        # The selection's inputs at the last run that made one ((budget, supported events, CPUs), the identities,
        # their target CPUs, the cgroup collector's snapshot they came from), and whether it left nothing to
        # retry: while they stay the same the selection stands (see _collect).
        self._sel_inputs: tuple | None = None
        self._sel_idents: list[ContainerIdentity] | None = None
        self._sel_targets: list[list[int]] | None = None
        self._sel_infos: object = None
        self._sel_retry: list[str] = []  # perf_event cgroup directories of the containers skipped for want of one
        self._stable = False
        self._narrowed: tuple[list[int], dict[frozenset[int], list[int]]] = ([], {})  # cpuset -> target CPUs
        self._force: set[str] = set()  # containers whose groups are read in the next run whatever their usage
        self._fds_total = 0  # descriptors held by all watched containers
        self._row: _Row | None = None
        self._cycle = 0  # runs so far
        self.idle_groups = 0  # watched containers whose groups the last run did not read (they did not run)
        self._skipped_keys: dict[tuple[str, str], tuple[tuple[str, Mapping[str, str]], ContainerIdentity]] = {}
        self._node_keys: dict[tuple[str, tuple], tuple[str, Mapping[str, str]]] = {}
        self._idx_cycles: int | None = None
        self._idx_instr: int | None = None
        self._units: list[float] = []  # per event: the factor from its count to its metric's unit
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
        self._idx_cycles = next((i for i, e in enumerate(events) if e.key == "cycles"), None)
        self._idx_instr = next((i for i, e in enumerate(events) if e.key == "instructions"), None)
        self._units = [_UNIT_SCALE.get(e.key, 1.0) for e in events]
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
        """The CPUs a container's groups are opened on: its cpuset as the cgroup collector read it last (with
        ``cpuset_only``), else every usable CPU."""
        return self._targets_of([ident], self.cpus(), getattr(self.discovery, "containers", {}))[0]

    def _targets_of(self, idents: list[ContainerIdentity], cpus: list[int],
                    infos: Mapping[str, object]) -> list[list[int]]:
        """:meth:`_target_cpus` of each of ``idents``; a node has few distinct cpusets, each narrowed once."""
        if not self.cfg.cpuset_only:
            return [cpus] * len(idents)
        cache = self._narrowed
        if cache[0] != cpus:
            cache = self._narrowed = (cpus, {})
        out = []
        for ident in idents:
            info = infos.get(ident.container_id)
            cs = info.stats.cpuset if info is not None else None  # type: ignore[attr-defined]
            if not cs:
                out.append(cpus)
                continue
            got = cache[1].get(cs)
            if got is None:
                if len(cache[1]) > 4096:
                    cache[1].clear()
                got = cache[1][cs] = [c for c in cpus if c in cs] or cpus
            out.append(got)
        return out

    def _sync_groups(self, root: PerfCgroupRoot, w: Watched, cpus: list[int]) -> None:
        want = set(cpus)
        if set(w.groups) != want:
            self._force.add(w.ident.container_id)  # groups change: read them this run
        for cpu in [c for c in w.groups if c not in want]:
            g = w.groups.pop(cpu)
            for i, v in g.last.items():
                w.retired[i] = w.retired.get(i, 0.0) + v
            w.retired_times_ns = (w.retired_times_ns[0] + g.times_ns[0], w.retired_times_ns[1] + g.times_ns[1])
            _close_group(g)
        missing = [c for c in cpus if c not in w.groups]
        if not missing:
            w.n_fds = w.fds
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
            w.n_fds = w.fds

    # -- collection --------------------------------------------------------------------------------
    def _rank(self, layout: CgroupLayout, idents: list[ContainerIdentity], targets: list[list[int]], now: float,
              refresh: bool = True):
        per_event = len(self.supported_events)
        ranked = []
        rates: dict[str, float] = {}
        # CPU usage as the cgroup collector read it last (with its time), so the same file is not read twice;
        # only when the ranking is redone (``refresh``) and that reading is not newer than ours is it read here.
        infos = getattr(self.discovery, "containers", {})
        prio_sel = self.cfg.priority
        extra_first = self.cfg.extra_cgroups_first
        for ident, cpus in zip(idents, targets, strict=True):
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
            prio = (extra_first and is_extra_cgroup(ident)) or (bool(prio_sel) and any(
                matches(s, ident) for s in prio_sel))
            ranked.append((ident, prio, len(cpus) * per_event, rates.get(cid, self._rate.get(cid, 0.0)), u or 0.0))
        self._rate = {**self._rate, **rates}
        ranked.sort(key=lambda r: (not r[1], -r[3], -r[4], r[0].container_id))
        return [(r[0], r[1], r[2]) for r in ranked]

    def collect(self, now: float) -> list[Sample]:
        return self.collect_row(now).samples()

    def collect_row(self, now: float) -> Columns:
        """The run's series as one row of :class:`Columns`: the keys list is the same object as the last run's
        while the watched and skipped containers stay the same, so the store resolves series only on change."""
        with self._lock:
            return self._collect(now)

    def _collect(self, now: float) -> Columns:
        mono = self.clock()
        if self._root is None or self._layout is None or mono - self._looked_at >= LAYOUT_REFRESH_SECONDS:
            layout = detect_layout(self.cgroup_root)
            root = find_perf_cgroup_root(self.cgroup_root)
            if layout is None or root is None:
                raise CollectorUnavailable(f"no cgroup hierarchy with perf_event under {self.cgroup_root}")
            self._looked_at = mono
        else:
            layout, root = self._layout, self._root
        if root != self._root:
            self._close()
            self._root = root
            self._events_probed = False
        if layout != self._layout:
            self._layout = layout
            for w in self.watched.values():
                w.usage_file.close()
                w.usage_path = ""
            self._row = None
        if not self._events_probed:
            self._probe_events(root)
        if not self.supported_events:
            raise CollectorUnavailable("none of the configured perf events is supported here: " + "; ".join(
                f"{k} ({v})" for k, v in self.unsupported.items()))

        idents = self.discovery.identities(layout)
        full = self._last_reselect is None or mono - self._last_reselect >= self.cfg.reselect_interval_seconds
        cpus = self.cpus()
        infos = getattr(self.discovery, "containers", {})
        budget = self.budget()
        # What the selection depends on. When none of it changed since a run whose selection left nothing to
        # retry (every container watched on its CPUs, or skipped for the budget), the selection stands: no
        # ranking, no planning, no group to open (the common run: containers that come and go change it).
        inputs = (budget, len(self.supported_events), cpus)
        same = (not full and self._stable and inputs == self._sel_inputs and idents == self._sel_idents
                and not any(map(os.path.isdir, self._sel_retry)))
        if same and infos is self._sel_infos:
            return self._fill(now, layout, selected=False)
        targets = self._targets_of(idents, cpus, infos)
        if same and targets == self._sel_targets:
            self._sel_infos = infos  # the cgroup collector ran again: no cpuset changed
            return self._fill(now, layout, selected=False)

        live = {i.container_id for i in idents}
        for cid in [c for c in self.watched if c not in live]:
            self._close_watched(self.watched.pop(cid))
        self._usage = {k: v for k, v in self._usage.items() if k in live}
        self._rate = {k: v for k, v in self._rate.items() if k in live}
        target_of = {i.container_id: t for i, t in zip(idents, targets, strict=True)}

        ranked = self._rank(layout, idents, targets, now, refresh=full)
        if full:
            self._last_reselect = mono
        # The cost of a watched container is what it holds; a newcomer's is cpus x supported events.
        held = {cid: w.n_fds for cid, w in self.watched.items()}
        ranked = [(i, p, held.get(i.container_id, c) or c) for i, p, c in ranked]
        chosen, not_chosen = plan_selection(ranked, set(self.watched), budget, full)

        skipped: dict[str, Skipped] = {i.container_id: Skipped(i, "budget") for i in not_chosen}
        for ident in not_chosen:
            gone = self.watched.pop(ident.container_id, None)
            if gone is not None:
                self._close_watched(gone)
        out_of_fds = False
        for ident in chosen:
            cid = ident.container_id
            if out_of_fds:
                skipped[cid] = Skipped(ident, "descriptor_limit")
                continue
            w = self.watched.get(cid) or Watched(ident)
            if w.prev_totals is None:
                self._force.add(cid)
            if w.ident != ident:  # names arrived from the runtime: new labels
                w.ident, w.keys, w._labels = ident, None, {}
                self._force.add(cid)
            try:
                self._sync_groups(root, w, target_of[cid])
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
        # Nothing to retry: every container watched on all its CPUs, or skipped for the budget, or for want of
        # its cgroup in the perf_event hierarchy (retried when that directory appears: runc makes a container's
        # directory in one hierarchy after another).
        self._stable = (all(s.reason in ("budget", "no_perf_cgroup") for s in skipped.values())
                        and all(len(w.groups) == len(target_of[cid]) for cid, w in self.watched.items()))
        self._sel_retry = [f"{root.path}/{s.ident.cgroup_path.strip('/')}" for s in skipped.values()
                           if s.reason == "no_perf_cgroup"]
        self._sel_inputs = (budget, len(self.supported_events), cpus)
        self._sel_idents, self._sel_targets, self._sel_infos = idents, targets, infos
        self._fds_total = sum(w.n_fds for w in self.watched.values())
        return self._fill(now, layout)

    def _keys_of(self, w: Watched) -> list[tuple[str, Mapping[str, str]]]:
        """A watched container's series in row slot order: one per configured event, then _ROW_SLOTS."""
        lab = w.labels()
        keys = []
        for ev in self.events:
            spec = _METRIC_OF_KEY.get(ev.key, M.CONTAINER_PERF_EVENTS)
            keys.append((spec.name, lab if ev.key else {**lab, "event": ev.name}))
        return keys + [(M.CONTAINER_CPI.name, lab), (M.CONTAINER_PERF_MONITORED.name, w.labels("reason")),
                       (M.CONTAINER_PERF_ENABLED.name, lab), (M.CONTAINER_PERF_RUNNING.name, lab),
                       (M.CONTAINER_PERF_DESCRIPTORS.name, lab)]

    def _skipped_key(self, s: Skipped) -> tuple[str, Mapping[str, str]]:
        got = self._skipped_keys.get((s.ident.container_id, s.reason))
        if got is None or got[1] is not s.ident:
            if len(self._skipped_keys) > 4 * max(1024, len(self.skipped)):
                self._skipped_keys.clear()  # containers gone: start again
            got = self._skipped_keys[(s.ident.container_id, s.reason)] = (
                (M.CONTAINER_PERF_MONITORED.name, LabelSet({**s.ident.labels(), "reason": s.reason})), s.ident)
        return got[0]

    def _key(self, metric: str, labels: Mapping[str, str]) -> tuple[str, Mapping[str, str]]:
        """The one key tuple of a node-level series."""
        k = (metric, tuple(labels.items()))
        got = self._node_keys.get(k)
        if got is None:
            if len(self._node_keys) > 1024:
                self._node_keys.clear()
            got = self._node_keys[k] = (metric, labels)
        return got

    def _tail(self) -> tuple[list[tuple[str, Mapping[str, str]]], list[float]]:
        """The node-level series: which events are supported, descriptors, budget, containers skipped."""
        keys: list[tuple[str, Mapping[str, str]]] = []
        values: list[float] = []
        for ev in self.events:
            err = self.unsupported.get(ev.name, "")
            keys.append(self._key(M.PERF_EVENT_SUPPORTED.name, {"event": ev.name, "error": err}))
            values.append(0.0 if err else 1.0)
        for name in self.cfg.events:
            if name in self.unsupported and not any(ev.name == name for ev in self.events):
                keys.append(self._key(M.PERF_EVENT_SUPPORTED.name, {"event": name, "error": self.unsupported[name]}))
                values.append(0.0)
        keys += [self._key(M.PERF_DESCRIPTORS.name, {}), self._key(M.PERF_DESCRIPTOR_BUDGET.name, {}),
                 self._key(M.PERF_CONTAINERS_SKIPPED.name, {})]
        values += [float(self._fds_total), float(self.budget()), float(len(self.skipped))]
        return keys, values

    @property
    def refresh_runs(self) -> int:
        """The groups of a container that did not run are read at least once in this many runs: the cgroup
        collector's ``idle_refresh_seconds`` over this collector's interval (1: every run)."""
        return self.discovery.idle_refresh_runs(self.cfg.interval_seconds)

    def _layout_row(self, layout: CgroupLayout, tail_keys: list[tuple[str, Mapping[str, str]]]) -> _Row:
        """Lay out the row for the watched and skipped containers of this run, carrying their values."""
        watched = list(self.watched.values())
        skipped = list(self.skipped.values())
        stride = len(self.events) + _ROW_SLOTS
        keys: list[tuple[str, Mapping[str, str]]] = []
        values: list[float] = []
        pfds: list[int] = []
        psize: list[int] = []
        pprev: list[bytes | None] = []
        pidx: list[int] = []
        ppos: list[int] = []
        noprobe: list[int] = []
        for i, w in enumerate(watched):
            if w.keys is None:
                w.keys = self._keys_of(w)
            if len(w.row) != stride:
                w.row = [math.nan] * stride
            keys += w.keys
            values += w.row
            if not w.usage_path:
                w.usage_path = _paths(layout, w.ident.cgroup_path, False)[0]
            fd = w.usage_file.fds.get(w.usage_path)
            if fd is None or w.usage is None:
                ppos.append(-1)
                noprobe.append(i)
                continue
            ppos.append(len(pfds))
            pidx.append(i)
            pfds.append(fd)
            psize.append(_ask(len(w.usage)))
            pprev.append(w.usage)
        for s in skipped:
            keys.append(self._skipped_key(s))
            values.append(0.0)
        tail_at = len(keys)
        keys += tail_keys
        values += [math.nan] * len(tail_keys)
        n = len(watched)
        return _Row(watched, skipped, tail_keys, keys, np.array(values, dtype=np.float64), stride, tail_at,
                    np.arange(n, dtype=np.int64) * stride + len(self.events) + _CPI,
                    np.array([w.read_cycle for w in watched], dtype=np.int64),
                    np.array([w.read_at for w in watched], dtype=np.float64),
                    pfds, psize, pprev, pidx, ppos, noprobe)

    def _fill(self, now: float, layout: CgroupLayout, selected: bool = True) -> Columns:
        """Read the groups of the watched containers that ran since their last read, and of those due for
        their idle refresh, into the row; the others' slots stand.

        Whether a container ran: its CPU usage file reads the same as at its last read (one kept-open
        descriptor per container, read for all in one C-level loop). Cgroup events count, and their
        enabled/running times advance, only while the cgroup runs on a CPU (kernel/events/core.c,
        perf_cgroup_event_time), so the counts of a container that did not run stand. The idle ones are
        read anyway at least once every :attr:`refresh_runs` runs (staggered), and when a run comes later
        than that many intervals. ``selected``: the selection was made in this run (else it stood: the same
        containers watched and skipped as when the row was laid out)."""
        tail_keys, tail_values = self._tail()
        row = self._row
        if row is None or row.tail_keys != tail_keys or (selected and (
                len(row.watched) != len(self.watched) or not all(map(is_, row.watched, self.watched.values()))
                or row.skipped != list(self.skipped.values()) or any(w.keys is None for w in row.watched))):
            row = self._row = self._layout_row(layout, tail_keys)
        self._cycle += 1
        cycle = self._cycle
        every = self.refresh_runs
        watched = row.watched
        got: list[bytes | None] = []
        if every > 1:
            todo = set(row.noprobe)
            if row.pfds:
                sizes = row.psize
                try:
                    got = list(map(os.pread, row.pfds, sizes, repeat(0, len(sizes))))
                except OSError:  # a cgroup removed before discovery saw it: read one by one
                    got = list(map(_pread_or_none, row.pfds, sizes))
                todo.update(compress(row.pidx, map(ne, got, row.pprev)))
                if None in got or any(map(eq, map(len, got), sizes)):  # type: ignore[arg-type]
                    # unreadable (read on its own), or as long as asked (it may have grown: ask for more)
                    for i, b, size in zip(row.pidx, got, sizes, strict=True):
                        if b is None or len(b) >= size:
                            todo.add(i)
                            if b is not None:
                                self._row = None  # laid out again after this run, with the sizes of now
            due = (cycle - row.read_cycle >= every) | (now - row.read_at >= every * self.cfg.interval_seconds)
            todo.update(np.flatnonzero(due).tolist())
            if self._force:
                todo.update(i for i, w in enumerate(watched) if w.ident.container_id in self._force)
        else:
            todo = set(range(len(watched)))
        self._force.clear()
        values = row.values
        if len(row.cpi):
            values[row.cpi] = math.nan  # CPI only where the groups were read (as the counts' delta)
        stride, n_ev = row.stride, len(self.events)
        self.idle_groups = len(watched) - len(todo)
        for i in sorted(todo):
            w = watched[i]
            j = row.ppos[i]
            usage = None
            if j >= 0:
                usage = got[j] if got else None
            elif every > 1:
                try:
                    usage = w.usage_file.read(w.usage_path or _paths(layout, w.ident.cgroup_path, False)[0])
                except _Gone:
                    usage = None
            first = w.prev_totals is None
            self._read_groups(w, n_ev)
            w.usage, w.read_at = usage, now
            # containers watched together refresh in turn
            w.read_cycle = cycle - i % every if first and every > 1 else cycle
            row.read_cycle[i], row.read_at[i] = w.read_cycle, now
            values[i * stride:(i + 1) * stride] = w.row
            if j < 0 and usage is not None and w.usage_file.fds.get(w.usage_path) is not None:
                self._row = None  # its usage file is open now: in the probe from the next run
        if got:
            row.pprev = got
        values[row.tail_at:] = tail_values
        return Columns(row.keys, values.copy())

    def _read_groups(self, w: Watched, n_ev: int) -> None:
        """Read a container's groups into ``w.row``: counts scaled for multiplexing and summed over its CPUs
        (with those of CPU groups closed before), CPI from the cycles and instructions deltas, the times."""
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
        out = [math.nan] * (n_ev + _ROW_SLOTS)
        units = self._units
        for i, v in totals.items():
            out[i] = v * units[i]
        ic, ii = self._idx_cycles, self._idx_instr
        if ic is not None and ii is not None and w.prev_totals is not None:
            dc = totals.get(ic, 0.0) - w.prev_totals.get(ic, 0.0)
            di = totals.get(ii, 0.0) - w.prev_totals.get(ii, 0.0)
            if di > 0 and dc >= 0:
                out[n_ev + _CPI] = dc / di
        w.prev_totals = totals
        w.times_ns = (enabled_ns, running_ns)
        out[n_ev + _MONITORED] = 1.0
        # The multiplexing made visible: counts above are scaled by enabled / running.
        out[n_ev + _ENABLED] = enabled_ns / 1e9
        out[n_ev + _RUNNING] = running_ns / 1e9
        out[n_ev + _DESCRIPTORS] = float(w.n_fds)
        w.row = out

    def _close_watched(self, w: Watched) -> None:
        for g in w.groups.values():
            _close_group(g)
        w.groups.clear()
        w.n_fds = 0
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
        self._row = None
        self._stable = False
        self._fds_total = 0
        self._looked_at = float("-inf")


def _close_group(g: CpuGroup) -> None:
    for fd in reversed(g.fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    g.fds.clear()


def _errtext(e: OSError) -> str:
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"{code}: {e.strerror}"

