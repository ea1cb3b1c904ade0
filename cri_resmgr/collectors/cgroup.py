"""Per-container CPU, throttling, memory and cpuset from the cgroup filesystem.

Files (Documentation/admin-guide/cgroup-v2.rst; cgroup-v1/{cpuacct,memory,cpusets}.rst,
Documentation/scheduler/sched-bwc.rst for v1 ``cpu.stat``):

====================  =================================  ==========================================
value                 cgroup v2                          cgroup v1
====================  =================================  ==========================================
CPU usage             cpu.stat ``usage_usec``             cpuacct/cpuacct.usage (ns)
CFS periods           cpu.stat ``nr_periods``             cpu/cpu.stat ``nr_periods``
throttled periods     cpu.stat ``nr_throttled``           cpu/cpu.stat ``nr_throttled``
throttled time        cpu.stat ``throttled_usec``         cpu/cpu.stat ``throttled_time`` (ns)
memory usage          memory.current                     memory/memory.usage_in_bytes
inactive file pages   memory.stat ``inactive_file``       memory/memory.stat ``total_inactive_file``
cpuset                cpuset.cpus.effective              cpuset/cpuset.effective_cpus
====================  =================================  ==========================================

Working set = usage − inactive file, floored at 0: the value the kubelet's eviction manager uses.

On hybrid hosts (v1 controllers plus a v2 tree at ``unified``, as on this machine) the v1 controllers
carry the accounting, so the collector reads v1 there.

Pressure stall information (Documentation/accounting/psi.rst, cgroup-v2.rst "PSI - Pressure Stall
Information"): ``cpu.pressure``, ``memory.pressure`` and ``io.pressure`` of the container's v2 cgroup
(the ``unified`` tree on hybrid hosts, where runc also makes the container's cgroup). Each holds
``some avg10=.. avg60=.. avg300=.. total=<µs>`` and ``full ...``; the ``total`` fields are exported as
counters in seconds. ``full`` of ``cpu.pressure`` is reported at cgroup level since 5.13 (zero before).

Cost: containers come from one change-driven discovery (:mod:`.discovery`, inotify), shared with the
hardware collectors; every file of a container is opened once and re-read with pread(2) at offset 0 (a
seq_file regenerates its text when read from offset 0 again: fs/seq_file.c ``seq_read_iter``), and only
the fields used are picked out of the bytes, without building a dict of every line.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import metrics as M
from ..config import CgroupCollectorConfig
from ..store import Columns, Sample
from ..sysfs import parse_cpulist
from .base import Collector, CollectorUnavailable, Probe
from .discovery import MAX_DEPTH, ContainerDiscovery
from .identity import ContainerIdentity, is_container_dir, parse_container_path
from .names import RuntimeNames

log = logging.getLogger(__name__)

__all__ = ["MAX_DEPTH", "CgroupCollector", "CgroupLayout", "ContainerStats", "detect_layout", "find_containers",
           "containers_in", "read_stats", "parse_pressure"]

PRESSURE_RESOURCES = ("cpu", "memory", "io")
READ_SIZE = 8192  # v1 memory.stat is ~1.5 KiB; every other file read here is a line or a few
# Descriptors kept free for everything else (sockets, perf's own budget is counted separately).
FD_HEADROOM = 1024


@dataclass(frozen=True)
class CgroupLayout:
    version: int  # 1 or 2
    root: Path  # where containers are discovered (v2 root, or the v1 cpuacct hierarchy)
    cpuacct: Path | None = None
    cpu: Path | None = None
    memory: Path | None = None
    cpuset: Path | None = None
    unified: Path | None = None  # v2 tree on hybrid hosts


def detect_layout(cgroup_root: Path) -> CgroupLayout | None:
    root = Path(cgroup_root)
    if (root / "cgroup.controllers").exists():
        return CgroupLayout(2, root, unified=root)

    def first(*names: str) -> Path | None:
        for n in names:
            if (root / n).is_dir():
                return root / n
        return None

    cpuacct = first("cpuacct", "cpu,cpuacct", "cpuacct,cpu")
    if cpuacct is None:
        return None
    unified = root / "unified" if (root / "unified" / "cgroup.controllers").exists() else None
    return CgroupLayout(
        1, cpuacct, cpuacct=cpuacct, cpu=first("cpu", "cpu,cpuacct", "cpuacct,cpu"),
        memory=first("memory"), cpuset=first("cpuset"), unified=unified,
    )


class Pressure(NamedTuple):
    """``total`` of the ``some`` and ``full`` lines of one ``*.pressure`` file, in seconds."""

    some_seconds: float | None
    full_seconds: float | None


def parse_pressure(text: str | bytes) -> Pressure:
    """Parse a PSI file (Documentation/accounting/psi.rst): ``some avg10=0.00 avg60=0.00 avg300=0.00
    total=1234`` and the same for ``full``; ``total`` is in microseconds. Missing or malformed lines
    give None."""
    if isinstance(text, str):
        text = text.encode()
    parts = text.split(b"total=")
    if len(parts) == 3 and text.startswith(b"some ") and b"\nfull " in parts[1]:
        try:  # the kernel's own layout (psi_show): both totals, some first
            return Pressure(int(parts[1].split(b"\n", 1)[0]) / 1e6, int(parts[2].split(b"\n", 1)[0]) / 1e6)
        except ValueError:
            pass
    out: dict[bytes, float] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(b" ")
        i = rest.find(b"total=")
        if i < 0 or kind not in (b"some", b"full"):
            continue
        try:
            out[kind] = int(rest[i + 6:].split(None, 1)[0]) / 1e6
        except (ValueError, IndexError):
            continue
    return Pressure(out.get(b"some"), out.get(b"full"))


def _psi_totals(buf: bytes) -> tuple[float | None, float | None]:
    """(some, full) totals of a PSI file in seconds: :func:`parse_pressure` without its objects, for the
    kernel's own layout (psi_show: ``some ... total=N\nfull ... total=N\n``); anything else goes there."""
    parts = buf.split(b"total=")
    if len(parts) == 3 and buf.startswith(b"some ") and b"\nfull " in parts[1]:
        try:
            return int(parts[1].split(b"\n", 1)[0]) / 1e6, int(parts[2]) / 1e6
        except ValueError:
            pass
    p = parse_pressure(buf)
    return p.some_seconds, p.full_seconds


class ContainerStats(NamedTuple):
    """One read of a container (a NamedTuple: one is made per container per cycle)."""

    cpu_usage_seconds: float | None = None
    cfs_periods: int | None = None
    cfs_throttled_periods: int | None = None
    cfs_throttled_seconds: float | None = None
    memory_usage_bytes: int | None = None
    memory_working_set_bytes: int | None = None
    cpuset: frozenset[int] | None = None
    # PSI totals in seconds: (some, full) of cpu, memory and io, in that order (None: not read); () when off
    psi_seconds: tuple[float | None, ...] = ()

    @property
    def pressure(self) -> tuple[tuple[str, Pressure], ...]:
        """(resource, totals) for each pressure file that was read."""
        p = self.psi_seconds
        return tuple((res, Pressure(p[2 * i], p[2 * i + 1])) for i, res in enumerate(PRESSURE_RESOURCES)
                     if len(p) > 2 * i and (p[2 * i] is not None or p[2 * i + 1] is not None))


class ContainerInfo(NamedTuple):
    identity: ContainerIdentity
    stats: ContainerStats = ContainerStats()
    last_seen: float = 0.0


def _keyed(buf: bytes) -> dict[bytes, int]:
    """``key value`` lines (cpu.stat) into a dict: one split of the whole buffer, pairs zipped."""
    it = buf.split()
    try:
        return dict(zip(it[::2], map(int, it[1::2]), strict=False))
    except ValueError:  # a malformed value somewhere: fall back to line by line
        out = {}
        for line in buf.splitlines():
            p = line.split()
            if len(p) == 2 and p[1].isdigit():
                out[p[0]] = int(p[1])
        return out


def _field(buf: bytes, key: bytes) -> int | None:
    """The value of ``key`` in a flat-keyed file (memory.stat) without parsing the other lines; ``key``
    starts with b"\\n" so that ``inactive_file`` does not match ``total_inactive_file``."""
    i = buf.find(key)
    if i < 0:
        return None
    j = i + len(key)
    k = buf.find(b"\n", j)
    try:
        return int(buf[j:k if k >= 0 else len(buf)])
    except ValueError:
        return None


def _int(buf: bytes | None) -> int | None:
    if buf is None:
        return None
    try:
        return int(buf)
    except ValueError:
        return None


_CPUS_SEEN: dict[bytes, frozenset[int]] = {}  # cpuset text -> set: a node has few distinct cpusets


def _cpus(buf: bytes | None) -> frozenset[int] | None:
    if buf is None:
        return None
    got = _CPUS_SEEN.get(buf)
    if got is not None:
        return got
    try:
        got = parse_cpulist(buf.decode())
    except ValueError:
        return None
    if len(_CPUS_SEEN) > 4096:
        _CPUS_SEEN.clear()
    _CPUS_SEEN[buf] = got
    return got


class _Gone(Exception):
    """The cgroup was removed (ENODEV/ENOENT on a kept descriptor)."""


# A file that could not be opened is tried again after 1, 2, 4, ... reads skipped, at most this many: a
# file missing for good (PSI off, a controller not mounted, cgroup.threads on v1) costs no open(2) per
# cycle, and one that appears late (runc makes a container's directory in one hierarchy after another)
# is picked up within a few cycles.
ABSENT_RETRY_MAX = 64


class OpenFiles:
    """A container's cgroup files, opened once and re-read with pread at offset 0; files that do not exist
    are remembered (and tried again now and then, see ABSENT_RETRY_MAX)."""

    __slots__ = ("fds", "absent", "_all")

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}
        self.absent: dict[str, list[int]] = {}  # path -> [reads still to skip, skips after the next failure]
        # read_all's paths when all are open: (paths, their descriptors, positions of those when some path is "")
        self._all: tuple[tuple[str, ...], list[int], list[int] | None] | None = None

    def read_all(self, paths: tuple[str, ...]) -> list[bytes | None]:
        """:meth:`read` of each of ``paths`` ("" gives None). When every one of them is open, this is one pread
        per file and nothing else (the common cycle); raises _Gone like :meth:`read`."""
        vec = self._all
        if vec is not None and vec[0] is paths:
            try:
                got = [os.pread(fd, READ_SIZE, 0) for fd in vec[1]]
            except OSError:
                got = None  # read() below finds which one failed, and how
            if got is not None and max(map(len, got), default=0) < READ_SIZE:  # else read() reads the rest
                if vec[2] is None:
                    return got  # type: ignore[return-value]
                out: list[bytes | None] = [None] * len(paths)
                for i, b in zip(vec[2], got, strict=True):
                    out[i] = b
                return out
        bufs = [self.read(p) if p else None for p in paths]
        if all(b is not None for b, p in zip(bufs, paths, strict=True) if p):
            where = [i for i, p in enumerate(paths) if p]
            self._all = (paths, [self.fds[paths[i]] for i in where], None if len(where) == len(paths) else where)
        else:
            self._all = None
        return bufs

    def read(self, path: str) -> bytes | None:
        """The file's whole text as bytes; None when it does not exist (a controller not mounted, an
        older kernel); raises _Gone when a descriptor that worked reports its cgroup removed."""
        fd = self.fds.get(path)
        if fd is None:
            miss = self.absent.get(path)
            if miss is not None and miss[0] > 0:
                miss[0] -= 1
                return None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                if miss is None:
                    self.absent[path] = [1, 2]
                else:
                    miss[0], miss[1] = miss[1], min(2 * miss[1], ABSENT_RETRY_MAX)
                return None
            if miss is not None:
                del self.absent[path]
            self.fds[path] = fd
        try:
            b = os.pread(fd, READ_SIZE, 0)
        except OSError as e:
            if e.errno in (errno.ENODEV, errno.ENOENT):
                raise _Gone() from None
            return None
        if len(b) == READ_SIZE:  # longer than expected: read the rest
            chunks = [b]
            while len(chunks[-1]) == READ_SIZE:
                chunks.append(os.pread(fd, READ_SIZE, READ_SIZE * len(chunks)))
            b = b"".join(chunks)
        return b

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        self.absent.clear()
        self._all = None


def _paths(layout: CgroupLayout, rel: str, pressure: bool) -> tuple[str, ...]:
    """The files of one container, in the order :func:`_parse` expects them."""
    rel = rel.strip("/")
    psi: tuple[str, ...] = ()
    if pressure and layout.unified is not None:
        u = f"{layout.unified}/{rel}/"
        psi = tuple(u + f"{r}.pressure" for r in PRESSURE_RESOURCES)
    if layout.version == 2:
        d = f"{layout.root}/{rel}/"
        return (d + "cpu.stat", d + "memory.current", d + "memory.stat", d + "cpuset.cpus.effective", "") + psi
    cs = f"{layout.cpuset}/{rel}/" if layout.cpuset else ""
    return (f"{layout.cpuacct}/{rel}/cpuacct.usage",
            f"{layout.cpu}/{rel}/cpu.stat" if layout.cpu else "",
            f"{layout.memory}/{rel}/memory.usage_in_bytes" if layout.memory else "",
            f"{layout.memory}/{rel}/memory.stat" if layout.memory else "",
            cs + "cpuset.effective_cpus" if cs else "") + psi


def _read_one(files: OpenFiles, layout: CgroupLayout, paths: tuple[str, ...]) -> ContainerStats | None:
    """Read and parse one container; None when its cgroup has gone."""
    r = files.read
    try:
        bufs = files.read_all(paths)
    except _Gone:
        return None
    pressure: tuple[float | None, ...] = ()
    if len(bufs) > 5:
        psi: list[float | None] = []
        for b in bufs[5:]:
            psi += _psi_totals(b) if b is not None else (None, None)
        pressure = tuple(psi)
    if layout.version == 2:
        if bufs[0] is None:
            return None
        cpu = _keyed(bufs[0])
        usage = cpu.get(b"usage_usec")
        mem = _int(bufs[1])
        inactive = _field(b"\n" + bufs[2], b"\ninactive_file ") if bufs[2] is not None else None
        return _stats(usage / 1e6 if usage is not None else None, cpu, b"throttled_usec", 1e6, mem, inactive,
                      _cpus(bufs[3]), pressure)
    usage_ns = _int(bufs[0])
    if bufs[0] is None and not os.path.isdir(os.path.dirname(paths[0])):
        return None
    cpu = _keyed(bufs[1]) if bufs[1] is not None else {}
    mem = _int(bufs[2])
    inactive = None
    if bufs[3] is not None:
        ms = b"\n" + bufs[3]
        inactive = _field(ms, b"\ntotal_inactive_file ")
        if inactive is None:
            inactive = _field(ms, b"\ninactive_file ")
    cpuset = _cpus(bufs[4])
    if cpuset is None and paths[4]:
        cpuset = _cpus(r(paths[4][: -len("effective_cpus")] + "cpus"))
    return _stats(usage_ns / 1e9 if usage_ns is not None else None, cpu, b"throttled_time", 1e9, mem, inactive,
                  cpuset, pressure)


def _stats(usage_seconds: float | None, cpu: dict[bytes, int], throttled_key: bytes, throttled_unit: float,
           mem_usage: int | None, inactive: int | None, cpuset: frozenset[int] | None,
           pressure: tuple[float | None, ...]) -> ContainerStats:
    return ContainerStats(
        cpu_usage_seconds=usage_seconds,
        cfs_periods=cpu.get(b"nr_periods"),
        cfs_throttled_periods=cpu.get(b"nr_throttled"),
        cfs_throttled_seconds=cpu[throttled_key] / throttled_unit if throttled_key in cpu else None,
        memory_usage_bytes=mem_usage,
        memory_working_set_bytes=(max(0, mem_usage - inactive) if mem_usage is not None and inactive is not None
                                  else mem_usage),
        cpuset=cpuset,
        psi_seconds=pressure,
    )


def read_stats(layout: CgroupLayout, rel: str, pressure: bool = True) -> ContainerStats | None:
    """Read one container's files once (opened and closed here); None when the cgroup has gone."""
    files = OpenFiles()
    try:
        return _read_one(files, layout, _paths(layout, rel, pressure))
    finally:
        files.close()


def find_containers(root: Path) -> list[ContainerIdentity]:
    """Walk ``root`` once for Kubernetes container cgroups (no watches); does not descend into them."""
    return ContainerDiscovery(root, use_inotify=False).containers()


def containers_in(paths: Iterable[str]) -> list[ContainerIdentity]:
    """The containers among cgroup paths already listed by another walk (e.g. the cgroup-id scan of the
    eBPF collector), so one tree is not walked twice per cycle."""
    out = []
    for p in paths:
        leaf = p.rsplit("/", 1)[-1]
        if is_container_dir(leaf):
            ident = parse_container_path(p)
            if ident is not None:
                out.append(ident)
    return out


@dataclass
class _Tracked:
    ident: ContainerIdentity
    labels: dict[str, str]
    paths: tuple[str, ...]
    files: OpenFiles = field(default_factory=OpenFiles)
    keys: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # its series, in _row's slot order

    def __post_init__(self) -> None:
        lab = self.labels
        self.keys = [(m, lab) for m in _STAT_METRICS] + [(_CPUSET, lab)]
        if len(self.paths) > 5:  # the pressure files: some and full of each resource
            self.keys += [(_PSI, {**lab, "resource": res, "kind": kind})
                          for res in PRESSURE_RESOURCES for kind in ("some", "full")]


def raise_nofile(want: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit towards ``want`` (at most the hard limit); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        return new
    except (ValueError, OSError) as e:
        log.warning("cannot raise RLIMIT_NOFILE to %d: %s", new, e)
        return soft


def runtime_names(cfg: CgroupCollectorConfig) -> RuntimeNames | None:
    """The CRI client that names containers, when ``collectors.cgroup.runtime_socket`` is set."""
    return RuntimeNames(cfg.runtime_socket, cfg.names_refresh_seconds) if cfg.runtime_socket else None


# The first six fields of ContainerStats, in order.
_STAT_METRICS = (M.CONTAINER_CPU_USAGE.name, M.CONTAINER_CPU_PERIODS.name, M.CONTAINER_CPU_THROTTLED_PERIODS.name,
                 M.CONTAINER_CPU_THROTTLED.name, M.CONTAINER_MEMORY_USAGE.name, M.CONTAINER_MEMORY_WORKING_SET.name)
_CPUSET = M.CONTAINER_CPUSET_CPUS.name
_PSI = M.CONTAINER_PRESSURE_STALLED.name


class CgroupCollector(Collector):
    """Reads every discovered container; also the one container discovery the hardware collectors use
    (:meth:`identities`)."""

    name = "cgroup"

    def __init__(self, cgroup_root: Path, cfg: CgroupCollectorConfig | None = None, names: RuntimeNames | None = None,
                 use_inotify: bool = True):
        self.cgroup_root = Path(cgroup_root)
        self.cfg = cfg or CgroupCollectorConfig()
        self.containers: dict[str, ContainerInfo] = {}
        self.names = names
        self.use_inotify = use_inotify
        self._version: int | None = None
        self._discovery: dict[str, ContainerDiscovery] = {}
        self._tracked: dict[str, _Tracked] = {}  # container id -> open files
        self._layout: CgroupLayout | None = None
        self._lock = threading.Lock()
        self.kept_open_limit = 0  # descriptors this collector may keep open (0: not computed yet)
        self._named_cache: tuple[object, dict[ContainerIdentity, ContainerIdentity]] = (None, {})
        self._row_order: list[_Tracked] = []  # the containers of the last row, in order
        self._row_keys: list[tuple[str, dict[str, str]]] = []  # and their series (Columns.keys)

    def reconfigure(self, cfg: CgroupCollectorConfig) -> None:
        """A new runtime socket or refresh interval replaces the runtime-names client; the rest is read per run."""
        if (cfg.runtime_socket, cfg.names_refresh_seconds) != (self.cfg.runtime_socket,
                                                               self.cfg.names_refresh_seconds):
            if self.names is not None:
                self.names.close()
            self.names = runtime_names(cfg)
        self.cfg = cfg

    def discovery(self, root: Path) -> ContainerDiscovery:
        """The shared change-driven discovery of ``root`` (made on first use)."""
        key = str(root)
        with self._lock:
            d = self._discovery.get(key)
            if d is None:
                d = self._discovery[key] = ContainerDiscovery(root, use_inotify=self.use_inotify)
            return d

    def status(self) -> str | None:
        parts = []
        if self._version:
            parts.append(f"cgroup v{self._version}")
            d = self._discovery.get(str(self._layout.root)) if self._layout else None
            if d is not None:
                parts.append(f"discovery: {d.mode} ({d.watches} watches, {d.walks_total} walks)")
            parts.append(f"{self.open_descriptors} files kept open")
        if self.names is not None and self.names.error:
            parts.append(self.names.error)
        return "; ".join(parts) or None

    def _named(self, ids: list[ContainerIdentity]) -> list[ContainerIdentity]:
        if self.names is None:
            return ids
        names = self.names.names(i.container_id for i in ids if not i.name)
        cache = self._named_cache  # identity -> named identity, valid while the runtime's answer is the same
        if cache[0] is not names:
            cache = self._named_cache = (names, {})
        out = []
        for i in ids:
            got = cache[1].get(i)
            if got is None:
                got = i
                n = names.get(i.container_id)
                if n is not None and not i.name:
                    got = replace(i, name=n.container, pod=n.pod, namespace=n.namespace, annotations=n.annotations)
                if len(cache[1]) > 4 * max(1024, len(ids)):
                    cache[1].clear()
                cache[1][i] = got
            out.append(got)
        return out

    def probe(self) -> Probe:
        layout = detect_layout(self.cgroup_root)
        if layout is None:
            return Probe(False, f"no cgroup hierarchy with CPU accounting under {self.cgroup_root}")
        return Probe(True, f"cgroup v{layout.version}")

    def identities(self, layout: CgroupLayout, found: list[ContainerIdentity] | None = None) -> list[ContainerIdentity]:
        """Containers under ``layout.root`` (from the change-driven discovery, unless ``found`` already
        lists them), named, plus the configured extra cgroups."""
        ids = self._named(found if found is not None else self.discovery(layout.root).containers())
        for extra in self.cfg.extra_cgroups:
            ids.append(
                ContainerIdentity(
                    container_id=extra.name, pod_uid="", qos_class="", runtime="",
                    cgroup_path="/" + extra.path.strip("/"), name=extra.name,
                    pod=extra.pod, namespace=extra.namespace,
                )
            )
        return ids

    @property
    def open_descriptors(self) -> int:
        return sum(len(t.files.fds) for t in self._tracked.values())

    def collect(self, now: float) -> list[Sample]:
        return self.collect_row(now).samples()

    def collect_row(self, now: float) -> Columns:
        """Every container's series as one row of :class:`Columns`: the keys list is kept while the containers
        stay the same, so the store resolves series only on change."""
        layout = detect_layout(self.cgroup_root)
        if layout is None:
            raise CollectorUnavailable(f"no cgroup hierarchy with CPU accounting under {self.cgroup_root}")
        if layout != self._layout:
            self._close_files()
            self._layout = layout
        self._version = layout.version
        pressure = self.cfg.pressure
        if not self.kept_open_limit:
            self.kept_open_limit = max(0, raise_nofile(1 << 20) - FD_HEADROOM)
        values: list[float | None] = []  # None: not read (NaN in the row)
        order: list[_Tracked] = []
        seen: dict[str, ContainerInfo] = {}
        tracked = self._tracked
        live: set[str] = set()
        held = 0  # descriptors kept by the containers read so far in this cycle
        limit = self.kept_open_limit
        want_psi = pressure and layout.unified is not None
        for ident in self.identities(layout):
            cid = ident.container_id
            live.add(cid)
            t = tracked.get(cid)
            if t is None or t.ident != ident or (len(t.paths) > 5) != want_psi:
                if t is not None:
                    t.files.close()
                t = tracked[cid] = _Tracked(ident, ident.labels(), _paths(layout, ident.cgroup_path, pressure))
            files = t.files
            st = _read_one(files, layout, t.paths)
            if held + len(files.fds) > limit:
                files.close()  # beyond the descriptor limit: this one is opened and closed every cycle
            held += len(files.fds)
            if st is None:
                files.close()
                del tracked[cid]
                continue
            seen[cid] = ContainerInfo(ident, st, now)
            order.append(t)
            values.extend(st[:6])
            # the cpuset's size only: a label listing the CPUs would make a new series at every cpuset change
            values.append(len(st.cpuset) if st.cpuset is not None else None)
            if len(t.keys) > 7:
                values.extend(st.psi_seconds)
        for cid in [c for c in tracked if c not in live]:
            tracked.pop(cid).files.close()
        self.containers = seen
        if len(order) != len(self._row_order) or any(a is not b for a, b in zip(order, self._row_order, strict=True)):
            self._row_order = order
            self._row_keys = [k for t in order for k in t.keys]  # a new list: the store re-resolves (cheaply)
        return Columns(self._row_keys, np.array(values, dtype=np.float64))

    def cpusets(self) -> dict[str, frozenset[int]]:
        """Container id -> effective cpuset, as the last :meth:`collect` read it (the CPU lists are not in
        the store: a label holding them would churn series). Safe from other threads: ``containers`` is
        replaced, never changed, by each collect."""
        return {cid: i.stats.cpuset for cid, i in self.containers.items() if i.stats.cpuset is not None}

    def _close_files(self) -> None:
        for t in self._tracked.values():
            t.files.close()
        self._tracked.clear()

    def close(self) -> None:
        self._close_files()
        with self._lock:
            for d in self._discovery.values():
                d.close()
            self._discovery.clear()
        if self.names is not None:
            self.names.close()
