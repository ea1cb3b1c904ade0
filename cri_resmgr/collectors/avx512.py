"""AVX-512 use per container and per CPU, from the eBPF program in ``cri_resmgr/ebpf/avx512.bpf.c``.

The kernel counts, per cgroup id (or per process on v1-only hosts) and per CPU, context switches whose saved
FPU state has ZMM_Hi256 in use, and all context switches (docs/avx512.md). Each run this collector reads
the maps, attributes keys to containers (:mod:`.cgroup_ids`), retires keys of cgroups or processes that
have gone (their last counts are kept per container, so container counters stay monotonic), and derives the
windowed ratio and the ``active`` flag with hysteresis.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import is_
from pathlib import Path
from typing import Literal

import numpy as np

from .. import metrics as M
from ..config import Avx512CollectorConfig, Paths
from ..ebpf.avx512 import DEFAULT_OBJECT, Avx512Source, BccSource, CounterKey, Counts, LibbpfSource, LoaderError
from ..ebpf.probe import choose_loader, probe_capabilities
from ..store import Columns, Sample
from ..topology import Topology
from .base import Collector, CollectorUnavailable, Probe
from .cgroup import CgroupLayout, containers_in, detect_layout, find_containers
from .cgroup_ids import CgroupIdResolver, PidResolver
from .discovery import ContainerDiscovery
from .identity import ContainerIdentity

log = logging.getLogger(__name__)

Mode = Literal["cgroup_id", "pid"]
RETRY_SECONDS = 60.0  # a failed probe or load is retried this often, not on every run
WARN_EVERY_SECONDS = 300.0
# Ids of cgroups other than containers that went away are noticed this often: by asking each counted id's file
# handle where the tree has them (CgroupIdResolver.recheck, ~7 µs an id), else by a walk of the whole tree (~20 ms
# at 1,000 containers). Where handles answer, the tree is still walked every WALK_SECONDS (containers come and go
# by inotify; the walk is the safety net).
RESCAN_SECONDS = 60.0
WALK_SECONDS = 600.0
# A cgroup id in the map that the last walk did not see (a cgroup made since) is looked up by a walk at most this
# often: new containers are seen at once (inotify), so such an id is nearly always another cgroup (a systemd scope,
# a runtime's shim, a test's): not a container's, and a node that makes them every second would otherwise walk the
# whole v2 tree every run. Until the walk its key is neither attributed nor retired; its counts are kept by the
# kernel and counted from the walk on (they are totals since the key was made).
UNKNOWN_RESCAN_SECONDS = 10.0


@dataclass(slots=True)
class RatioWindow:
    """Ratio of two monotonic counters' increases over the last ``window`` seconds.

    The base is the newest point at least ``window`` old (or the oldest one, early on); with no
    denominator increase in the window the ratio is 0: the task did not run (a task that runs always
    gets switched out now and then, by ticks and kernel threads).
    """

    # (time, numerator, denominator), oldest first: a few points (the window over the collector's interval), so a
    # list, not a deque (64 bytes against 760 for one point)
    points: list[tuple[float, int, int]] = field(default_factory=list)

    def update(self, t: float, num: int, den: int, window: float) -> float:
        if self.points and (num < self.points[-1][1] or den < self.points[-1][2]):
            self.points.clear()  # counter reset (program reloaded)
        self.points.append((t, num, den))
        while len(self.points) >= 2 and self.points[1][0] <= t - window:
            del self.points[0]
        _, n0, d0 = self.points[0]
        return (num - n0) / (den - d0) if den > d0 else 0.0


def next_active(prev: bool, ratio: float, threshold: float, hysteresis: float) -> bool:
    """Set at ``ratio >= threshold``; cleared only below ``threshold * (1 - hysteresis)``."""
    return ratio >= threshold * (1.0 - hysteresis) if prev else ratio >= threshold


@dataclass(frozen=True)
class Attribution:
    mode: Mode
    ident_layout: CgroupLayout  # where containers are discovered for this mode
    v2_root: Path | None = None  # cgroup_id mode
    controller: str | None = None  # pid mode: v1 controller whose hierarchy names the container


def choose_attribution(pref: Literal["auto", "cgroup_id", "pid"], layout: CgroupLayout) -> Attribution:
    """cgroup id where a v2 tree exists (pure v2, or ``unified`` on hybrid hosts), else per process."""
    v2 = layout.root if layout.version == 2 else layout.unified
    if pref == "cgroup_id" and v2 is None:
        raise CollectorUnavailable("attribution cgroup_id needs a cgroup v2 tree (v2 root or <cgroup>/unified)")
    if pref != "pid" and v2 is not None:
        return Attribution("cgroup_id", CgroupLayout(2, v2, unified=v2), v2_root=v2)
    return Attribution("pid", layout, controller=None if layout.version == 2 else "cpuacct")


# A container's slots in the row, in this order (the last use is NaN, i.e. not written, until there was one).
_CONTAINER_METRICS = (M.CONTAINER_AVX512_SWITCHES.name, M.CONTAINER_CONTEXT_SWITCHES.name,
                      M.CONTAINER_AVX512_RATIO.name, M.CONTAINER_AVX512_ACTIVE.name, M.CONTAINER_AVX512_LAST_USE.name)
_SLOTS = len(_CONTAINER_METRICS)
_ZERO = Counts()


@dataclass
class _Row:
    """The row as laid out for a set of containers and CPUs: ``keys`` handed to the store unchanged while
    these stay; ``values`` the last run's, updated in place."""

    cids: list[str]
    idents: list[ContainerIdentity]
    cpus: list[int]
    keys: list[tuple[str, Mapping[str, str]]]
    index: dict[str, int]  # container -> its first slot
    cpu_at: int  # the first per-CPU slot
    values: np.ndarray


def open_source(loader: str, cfg: Avx512CollectorConfig, key_by_tgid: bool) -> Avx512Source:
    if loader == "libbpf":
        return LibbpfSource(cfg.object_path or DEFAULT_OBJECT, cfg.map_entries, key_by_tgid)
    return BccSource(cfg.map_entries, key_by_tgid)


class Avx512Collector(Collector):
    name = "avx512"

    def __init__(self, cfg: Avx512CollectorConfig, paths: Paths, topology: Topology,
                 identities: Callable[..., list[ContainerIdentity]] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.paths = paths
        self.topology = topology
        # (layout, found=None) -> containers: the cgroup collector's, so names and extra cgroups apply.
        self.identities = identities or (lambda layout, found=None: found if found is not None
                                         else find_containers(layout.root))
        self.clock = clock
        self.source: Avx512Source | None = None
        self.attribution: Attribution | None = None
        self.reason = "not probed yet"
        self._retry_at = 0.0
        self._attach_t = 0.0
        self._cg: CgroupIdResolver | None = None
        self._v2_discovery: ContainerDiscovery | None = None
        self._found: list[ContainerIdentity] | None = None  # containers of the last walk of the v2 tree
        self._scanned_at = 0.0
        self._checked_at = 0.0  # the last walk or recheck of the counted ids
        self._assigned = False
        self._pid: PidResolver | None = None
        self._owner: dict[CounterKey, str | None] = {}  # key -> container_id (None: not a container)
        self._seen: dict[CounterKey, Counts] = {}
        self._retired: dict[str, Counts] = {}
        self._windows: dict[str, RatioWindow] = {}
        self._active: dict[str, bool] = {}
        self._cpu_windows: dict[int, RatioWindow] = {}
        self._row: _Row | None = None
        self._quiet: dict[str, Counts] = {}  # container -> its counts when its ratio was last 0 (not active)
        self.failed_inserts = 0
        self._warned_at = -WARN_EVERY_SECONDS

    def reconfigure(self, cfg: Avx512CollectorConfig) -> None:
        """Config reload: window, threshold and hysteresis apply from the next run; the map size, loader
        and attribution are bound when the program is loaded and need a restart."""
        bound = [k for k in ("map_entries", "loader", "attribution", "object_path", "kernel_modules_dir")
                 if getattr(cfg, k) != getattr(self.cfg, k)]
        if bound and self.source is not None:
            log.warning("avx512: %s change(s) apply after a restart", ", ".join(bound))
        self.cfg = cfg

    # -- probe and load -----------------------------------------------------------------------------
    def probe(self) -> Probe:
        if self.source is not None:
            return Probe(True, self._status())
        now = self.clock()
        if now < self._retry_at:
            return Probe(False, self.reason)
        self._retry_at = now + RETRY_SECONDS
        layout = detect_layout(self.paths.cgroup)
        if layout is None:
            self.reason = f"no cgroup hierarchy under {self.paths.cgroup}"
            return Probe(False, self.reason)
        try:
            attribution = choose_attribution(self.cfg.attribution, layout)
        except CollectorUnavailable as e:
            self.reason = str(e)
            return Probe(False, self.reason)
        report = probe_capabilities(self.paths.sysfs, self.paths.proc, self.cfg.object_path or DEFAULT_OBJECT,
                                    self.cfg.kernel_modules_dir)
        choice = choose_loader(self.cfg.loader, report)
        if choice.loader is None:
            self.reason = choice.reason
            return Probe(False, self.reason)
        try:
            self.source = open_source(choice.loader, self.cfg, key_by_tgid=attribution.mode == "pid")
        except LoaderError as e:
            self.reason = f"{choice.loader} loader failed: {e}"
            return Probe(False, self.reason)
        self.attribution = attribution
        if attribution.mode == "cgroup_id":
            assert attribution.v2_root is not None  # set in cgroup_id mode
            self._cg = CgroupIdResolver(attribution.v2_root)
            _ = self._cg.handles  # opened now, so that the status says whether new cgroup ids wait for walks
        else:
            self._pid = PidResolver(self.paths.proc, attribution.controller)
        self._attach_t = self.clock()
        log.info("avx512: %s attached (%s); attribution by %s", choice.loader, ", ".join(self.source.attached),
                 attribution.mode)
        self.reason = self._status()
        return Probe(True, self.reason)

    def _status(self) -> str:
        assert self.source is not None and self.attribution is not None
        s = f"{self.source.loader}; attribution by {self.attribution.mode}"
        if self._cg is not None and self._cg.handles is None:
            s += f" (cgroup ids made between walks wait for a walk: {self._cg.handles_reason})"
        if self.failed_inserts:
            s += (f"; counts map full: {self.failed_inserts} events not attributed - raise "
                  f"collectors.avx512.map_entries (now {self.source.capacity})")
        return s

    # -- collect ------------------------------------------------------------------------------------
    def _resolve(self, key: CounterKey, counts: Counts) -> tuple[bool, str | None]:
        """(alive, container_id) of a key."""
        if self._cg is not None:
            if not self._cg.alive(key.cgroup_id):
                return False, None
            ident = self._cg.container(key.cgroup_id)
            return True, ident.container_id if ident else None
        assert self._pid is not None
        if not self._pid.alive(key.tgid):
            return False, None
        if key in self._owner and self._seen.get(key) == counts:
            return True, self._owner[key]  # idle since last run: keep the cached owner
        ident = self._pid.container(key.tgid)
        return True, ident.container_id if ident else None

    def collect(self, now: float) -> list[Sample]:
        return self.collect_row(now).samples()

    def collect_row(self, now: float) -> Columns:
        """The run's series as one row of :class:`Columns`: the keys list is the same object while the
        containers and CPUs stay the same, and only the slots of containers whose counts moved, or whose
        ratio is not 0, are computed again (the others' values stand: see the loop below)."""
        if self.source is None or self.attribution is None:
            raise CollectorUnavailable(self.reason)
        try:
            snap = self.source.read()
        except LoaderError as e:
            raise CollectorUnavailable(f"reading the BPF maps failed: {e}") from None
        t = self.clock()
        mono_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
        # Discover after reading the map: a key read above whose cgroup is absent now has really gone.
        layout = self.attribution.ident_layout
        waiting: set[int] = set()  # cgroup ids that the last walk did not see and that wait for the next
        if self._cg is not None:
            # One walk of the v2 tree serves both the id -> path map and container discovery; it is redone
            # only when something changed: inotify saw a container come or go, or WALK_SECONDS passed. Every
            # RESCAN_SECONDS the counted ids of other cgroups that went away are found by file handle, or by a
            # walk where handles cannot say. An id made since the last walk is looked up by its file handle;
            # where that cannot be done, it waits for a walk, UNKNOWN_RESCAN_SECONDS after the last at most.
            if self._v2_discovery is None:
                self._v2_discovery = ContainerDiscovery(self._cg.v2_root)
            changed = self._v2_discovery.poll()
            paths = self._cg.paths
            walk = changed or self._found is None or t - self._scanned_at >= WALK_SECONDS
            unknown = [] if walk else [k.cgroup_id for k in snap.counts if k.cgroup_id not in paths]
            if not walk and t - self._checked_at >= RESCAN_SECONDS:  # (the known ones: none of ``unknown``)
                walk = not self._cg.recheck({k.cgroup_id for k in snap.counts})
                self._checked_at = t
            if not walk:
                waiting = self._cg.lookup(unknown) if unknown else waiting
                walk = bool(waiting) and t - self._scanned_at >= UNKNOWN_RESCAN_SECONDS
            if walk:
                waiting = set()
                found = containers_in(self._cg.scan().values())
                # The same containers as the last walk keep their identity objects: the row (laid out again when
                # an identity is another object) and the store's column plan stand across the WALK_SECONDS walk.
                prev = {i.container_id: i for i in self._found or ()}
                self._found = [p if (p := prev.get(i.container_id)) is not None and p == i else i for i in found]
                self._scanned_at = self._checked_at = t
                self._assigned = False
            containers = {c.container_id: c for c in self.identities(layout, self._found)}
            if not self._assigned:
                self._cg.assign(list(containers.values()))
                self._assigned = True
        else:
            assert self._pid is not None
            containers = {c.container_id: c for c in self.identities(layout)}
            self._pid.refresh(list(containers.values()))

        live: dict[str, Counts] = {}
        dead: list[CounterKey] = []
        for key, counts in snap.counts.items():
            if key.cgroup_id in waiting:
                continue  # made since the last walk: looked up at the next one
            alive, cid = self._resolve(key, counts)
            if not alive:
                dead.append(key)
                continue
            self._owner[key] = cid
            self._seen[key] = counts
            if cid is not None:
                live[cid] = live.get(cid, Counts()) + counts
        if dead:
            for key, final in self.source.retire(dead).items():
                cid = self._owner.get(key)
                if cid is not None and cid in containers:
                    self._retired[cid] = self._retired.get(cid, Counts()) + final
            for key in dead:
                self._owner.pop(key, None)
                self._seen.pop(key, None)
        for key in [k for k in self._owner if k not in snap.counts]:
            self._owner.pop(key, None)
            self._seen.pop(key, None)

        # Per container: the retired keys' final counts plus the live keys' (only containers with counts).
        totals = dict(live)
        for cid, c in self._retired.items():
            totals[cid] = c + totals[cid] if cid in totals else c
        cpus = [cpu for cpu in range(len(snap.cpus)) if not self.topology.cpus or cpu in self.topology.cpus]
        row = self._row
        cids = list(containers)
        if (row is None or row.cids != cids or not all(map(is_, row.idents, containers.values()))
                or row.cpus != cpus):
            row = self._row = self._layout_row(containers, cpus, row)
        values = row.values
        cfg = self.cfg
        quiet = self._quiet
        zero = _ZERO
        # A container whose counts stand and whose ratio was 0 (so not active) keeps its slots: its ratio stays
        # 0 however the window slides (no increase of the numerator since the base, or none of the
        # denominator), and the window's base keeps the same counts without the points in between.
        # (Counts are immutable: the same object is the same counts; an idle container without keys has the _ZERO
        # object in both, so most are passed over without comparing fields.)
        for cid in [c for c in cids if (kept := quiet.get(c)) is None or ((cur := totals.get(c, zero)) is not kept
                                                                         and cur != kept)]:
            total = totals.get(cid, zero)
            win = self._windows.get(cid)
            if win is None:
                # Counting started at attach (or at the cgroup's creation, later): zero at attach time.
                win = self._windows[cid] = RatioWindow([(self._attach_t, 0, 0)])
            ratio = win.update(t, total.avx512_switches, total.switches, cfg.window_seconds)
            active = self._active[cid] = next_active(self._active.get(cid, False), ratio, cfg.active_threshold,
                                                     cfg.active_hysteresis)
            i = row.index[cid]
            values[i:i + _SLOTS] = (float(total.avx512_switches), float(total.switches), ratio,
                                    1.0 if active else 0.0,
                                    now - (mono_ns - total.last_avx512_ns) / 1e9 if total.last_avx512_ns
                                    else math.nan)
            if ratio == 0.0 and not active:
                quiet[cid] = total
            else:
                quiet.pop(cid, None)

        k = row.cpu_at
        for cpu in cpus:
            tot = snap.cpus[cpu]
            win = self._cpu_windows.setdefault(cpu, RatioWindow([(self._attach_t, 0, 0)]))
            values[k] = float(tot.avx512_switches)
            values[k + 1] = win.update(t, tot.avx512_switches, tot.switches, cfg.window_seconds)
            k += 2

        failed = snap.failed_inserts
        if failed > self.failed_inserts and t - self._warned_at >= WARN_EVERY_SECONDS:
            self._warned_at = t
            log.warning("avx512: counts map full (%d entries): %d events not attributed so far; raise "
                        "collectors.avx512.map_entries", snap.capacity, failed)
        self.failed_inserts = failed
        values[k:k + 3] = (float(len(snap.counts) - len(dead)), float(snap.capacity), float(failed))
        return Columns(row.keys, values.copy())

    def _layout_row(self, containers: dict[str, ContainerIdentity], cpus: list[int], old: _Row | None) -> _Row:
        """The row's series for these containers and CPUs; the slots of containers already in ``old`` keep
        their values. State of containers that went is dropped."""
        keys: list[tuple[str, Mapping[str, str]]] = []
        index: dict[str, int] = {}
        for cid, ident in containers.items():
            lab: Mapping[str, str] = ident.labels()
            index[cid] = len(keys)
            keys += [(m, lab) for m in _CONTAINER_METRICS]
        cpu_at = len(keys)
        for cpu in cpus:
            lab = self.topology.cpu_labels(cpu)
            keys += [(M.CPU_AVX512_SWITCHES.name, lab), (M.CPU_AVX512_RATIO.name, lab)]
        keys += [(M.AVX512_MAP_ENTRIES.name, {}), (M.AVX512_MAP_CAPACITY.name, {}),
                 (M.AVX512_MAP_INSERT_FAILURES.name, {})]
        values = np.full(len(keys), math.nan)
        if old is not None:
            kept = [(i, old.index[cid]) for cid, i in index.items() if cid in old.index]
            if kept:
                new_at, old_at = (np.repeat(np.array(x, dtype=np.int64), _SLOTS) + np.tile(np.arange(_SLOTS), len(x))
                                  for x in zip(*kept, strict=True))
                values[new_at] = old.values[old_at]
        for d in (self._windows, self._active, self._retired, self._quiet):
            for cid in [c for c in d if c not in containers]:
                del d[cid]
        return _Row(list(containers), list(containers.values()), cpus, keys, index, cpu_at, values)

    def close(self) -> None:
        if self._cg is not None:
            self._cg.close()
        if self._v2_discovery is not None:
            self._v2_discovery.close()
            self._v2_discovery = None
        if self.source is not None:
            self.source.close()
            self.source = None
