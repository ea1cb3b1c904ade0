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
import functools
import logging
import math
import os
import resource
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from itertools import accumulate, compress, repeat
from operator import eq, ne
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import metrics as M
from ..config import CgroupCollectorConfig
from ..store import Columns, LabelSet, Sample
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


def _ask(length: int) -> int:
    """Bytes to ask of a file that held ``length`` last time: a power of two above twice that, 64 to READ_SIZE."""
    return min(READ_SIZE, max(64, 1 << (2 * length).bit_length()))


_REL = "\0"  # where a container's cgroup path goes in a path template (:func:`_templates`; no path holds a NUL)


class OpenFiles:
    """A container's cgroup files, opened once and re-read with pread at offset 0; files that do not exist
    are remembered (and tried again now and then, see ABSENT_RETRY_MAX).

    With ``rel`` (a container's cgroup path), the paths it is given are the templates of :func:`_templates`, the
    same strings for every container, and ``rel`` is put in only to open a file (:meth:`path_of`): the
    descriptors are then keyed by the shared templates, not by eight or so paths of ~150 characters held for each
    container (~3.5 MB of RSS at 1,000, docs/hardware-collectors.md)."""

    __slots__ = ("fds", "absent", "_all", "rel")

    def __init__(self, rel: str = "") -> None:
        self.rel = rel
        self.fds: dict[str, int] = {}
        self.absent: dict[str, list[int]] = {}  # path -> [reads still to skip, skips after the next failure]
        # read_all's paths when all are open: (paths, their descriptors, the bytes to ask of each, positions of
        # those when some path is "")
        self._all: tuple[tuple[str, ...], list[int], list[int], list[int] | None] | None = None

    def read_all(self, paths: tuple[str, ...]) -> list[bytes | None]:
        """:meth:`read` of each of ``paths`` ("" gives None). When every one of them is open, this is one pread
        per file and nothing else (the common cycle), each asking for about twice what the file held last time
        (a smaller buffer is cheaper to allocate); raises _Gone like :meth:`read`."""
        vec = self._all
        if vec is not None and vec[0] is paths:
            sizes = vec[2]
            try:
                got = list(map(os.pread, vec[1], sizes, repeat(0, len(sizes))))
            except OSError:
                got = None  # read() below finds which one failed, and how
            if got is not None and not any(map(eq, map(len, got), sizes)):  # else read() reads the rest
                if vec[3] is None:
                    return got  # type: ignore[return-value]
                out: list[bytes | None] = [None] * len(paths)
                for i, b in zip(vec[3], got, strict=True):
                    out[i] = b
                return out
        bufs = [self.read(p) if p else None for p in paths]
        if all(b is not None for b, p in zip(bufs, paths, strict=True) if p):
            where = [i for i, p in enumerate(paths) if p]
            self._all = (paths, [self.fds[paths[i]] for i in where], [_ask(len(bufs[i] or b"")) for i in where],
                         None if len(where) == len(paths) else where)
        else:
            self._all = None
        return bufs

    def path_of(self, path: str) -> str:
        """The file that ``path`` (a template when this has a ``rel``) names."""
        return path.replace(_REL, self.rel, 1) if self.rel else path

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
                fd = os.open(self.path_of(path), os.O_RDONLY | os.O_CLOEXEC)
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


@functools.lru_cache(maxsize=16)
def _templates(layout: CgroupLayout, pressure: bool) -> tuple[str, ...]:
    """The files of a container, in the order :func:`_parse` expects them, as templates: ``_REL`` stands where
    its cgroup path (``/``-led, see :func:`_rel`) goes; "" where the layout has no such file. One tuple per
    layout, shared by every container (:class:`OpenFiles` with ``rel``)."""
    psi: tuple[str, ...] = ()
    if pressure and layout.unified is not None:
        u = f"{layout.unified}{_REL}/"
        psi = tuple(u + f"{r}.pressure" for r in PRESSURE_RESOURCES)
    if layout.version == 2:
        d = f"{layout.root}{_REL}/"
        return (d + "cpu.stat", d + "memory.current", d + "memory.stat", d + "cpuset.cpus.effective", "") + psi
    cs = f"{layout.cpuset}{_REL}/" if layout.cpuset else ""
    return (f"{layout.cpuacct}{_REL}/cpuacct.usage",
            f"{layout.cpu}{_REL}/cpu.stat" if layout.cpu else "",
            f"{layout.memory}{_REL}/memory.usage_in_bytes" if layout.memory else "",
            f"{layout.memory}{_REL}/memory.stat" if layout.memory else "",
            cs + "cpuset.effective_cpus" if cs else "") + psi


def _rel(rel: str) -> str:
    """A cgroup path as the templates take it: one leading ``/``, none trailing; ``rel`` itself when it is so (a
    ContainerIdentity's is: its string, not a copy, is then what a container's OpenFiles holds)."""
    r = "/" + rel.strip("/")
    return rel if r == rel else r


def _paths(layout: CgroupLayout, rel: str, pressure: bool) -> tuple[str, ...]:
    """The files of one container, in the order :func:`_parse` expects them."""
    r = _rel(rel)
    return tuple(t.replace(_REL, r, 1) for t in _templates(layout, pressure))


def _read_one(files: OpenFiles, layout: CgroupLayout, paths: tuple[str, ...]) -> ContainerStats | None:
    """Read and parse one container; None when its cgroup has gone."""
    try:
        bufs = files.read_all(paths)
    except _Gone:
        return None
    return _parse(files, layout, paths, bufs)


def _parse(files: OpenFiles, layout: CgroupLayout, paths: tuple[str, ...],
           bufs: list[bytes | None]) -> ContainerStats | None:
    """One container's stats from the text of its files (``bufs``, in ``paths`` order); None when gone."""
    r = files.read
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
    if bufs[0] is None and not os.path.isdir(os.path.dirname(files.path_of(paths[0]))):
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
        try:
            cpuset = _cpus(r(paths[4][: -len("effective_cpus")] + "cpus"))
        except _Gone:
            return None
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


# Positions in :func:`_paths` of the files read every cycle for every container (the "did anything happen"
# check): CPU usage and the effective cpuset. The rest is read only when one of them changed, or when the
# container is due for its idle refresh (see CgroupCollector).
PROBE_POSITIONS = {2: (0, 3), 1: (0, 4)}


@dataclass
class _Tracked:
    ident: ContainerIdentity
    labels: Mapping[str, str]
    paths: tuple[str, ...]
    files: OpenFiles = field(default_factory=OpenFiles)
    keys: list[tuple[str, Mapping[str, str]]] = field(default_factory=list)  # its series, in _row's slot order
    stats: ContainerStats | None = None  # of its last full read (None: not read yet)
    values: list[float | None] = field(default_factory=list)  # its row slots from that read (None: not read)
    probe: tuple[int, ...] = ()  # positions in ``paths`` checked every cycle (kept open), see PROBE_POSITIONS
    rest: tuple[str, ...] = ()  # ``paths`` with the probe positions blanked: what a full read still reads
    seen: dict[int, bytes] = field(default_factory=dict)  # probe position -> its text at the last read
    # hash() of every file's text at the last full read (None: none parsed): the texts themselves took ~2 MB at
    # 1,000 containers. Python's bytes hash is 64-bit SipHash with a per-process key (PEP 456): a change hashing
    # the same, which would keep the last stats until the next change, has a chance of 2**-64 a read.
    digest: int | None = None
    last_full: int = 0  # the collector's cycle of its last full read

    def __post_init__(self) -> None:
        lab: Mapping[str, str] = self.labels
        self.keys = [(m, lab) for m in _STAT_METRICS] + [(_CPUSET, lab)]
        if len(self.paths) > 5:  # the pressure files: some and full of each resource
            # (LabelSets: the store's tuple, not a dict of eight labels per series: ~1.6 MB at 1,000 containers)
            self.keys += [(_PSI, LabelSet({**lab, "resource": res, "kind": kind}))
                          for res in PRESSURE_RESOURCES for kind in ("some", "full")]
        self.rest = self.paths

    def open_probe(self, positions: tuple[int, ...]) -> tuple[int, ...]:
        """The probe positions whose files are open now."""
        fds = self.files.fds
        return tuple(j for j in positions if self.paths[j] and self.paths[j] in fds)

    def set_probe(self, probe: tuple[int, ...]) -> None:
        self.probe = probe
        self.rest = tuple("" if j in probe else p for j, p in enumerate(self.paths)) if probe else self.paths

    def full_read(self, layout: CgroupLayout, got: dict[int, bytes]) -> ContainerStats | None:
        """Read the files not in ``got`` (probe position -> text read this cycle) and parse all; None: gone."""
        paths = self.rest if got and len(got) == len(self.probe) else self.paths
        try:
            bufs = self.files.read_all(paths)
        except _Gone:
            return None
        if paths is self.rest:
            for j, b in got.items():
                bufs[j] = b
        digest = hash(tuple(bufs))
        if digest == self.digest and self.stats is not None:
            return self.stats  # nothing changed since the last full read (the common idle refresh): no parsing
        st = _parse(self.files, layout, self.paths, bufs)
        self.digest = digest if st is not None else None
        if st is not None:
            seen: dict[int, bytes] = {}
            for j in PROBE_POSITIONS[layout.version]:
                v = bufs[j]
                if v is not None:
                    seen[j] = v
            self.seen = seen
        return st


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
    (:meth:`identities`).

    Cost scales with change, not with the number of containers: each cycle reads, for every container, only
    its CPU usage and effective cpuset (:data:`PROBE_POSITIONS`, two kept-open descriptors read with pread in
    one C-level loop), and compares the bytes with the previous cycle's. The other files (memory, throttling,
    PSI) are read only for containers whose probe changed, and for the others once every
    ``idle_refresh_seconds`` (staggered over the cycles, so no cycle reads everything). Why the probe says
    enough: CPU usage (cpuacct.usage, cpu.stat ``usage_usec``) is the tasks' run time, and CFS periods and
    throttling are only counted while the cgroup runs (kernel/sched/fair.c, ``__account_cfs_rq_runtime``);
    what can move while no task of the container runs is memory (reclaim, socket buffers charged in softirq)
    and PSI stall time of tasks blocked on I/O or memory, hence the bounded idle refresh. The values of a
    container not read in full are its last ones, written again (series without gaps, counters monotonic).
    """

    name = "cgroup"

    def __init__(self, cgroup_root: Path, cfg: CgroupCollectorConfig | None = None, names: RuntimeNames | None = None,
                 use_inotify: bool = True):
        self.cgroup_root = Path(cgroup_root)
        self.cfg = cfg or CgroupCollectorConfig()
        self.names = names
        self.use_inotify = use_inotify
        self._version: int | None = None
        self._discovery: dict[str, ContainerDiscovery] = {}
        self._tracked: dict[str, _Tracked] = {}  # container id -> open files
        self._layout: CgroupLayout | None = None
        self._lock = threading.Lock()
        self.kept_open_limit = 0  # descriptors this collector may keep open (0: not computed yet)
        self._named_cache: tuple[object, dict[ContainerIdentity, ContainerIdentity]] = (None, {})
        self.cycle = 0  # runs so far
        self.full_reads = 0  # containers read in full in the last run
        # Files read by each run, one list per run, when a list (the benchmark's C floor reads the same).
        self.read_log: list[list[str]] | None = None
        self._reset()

    def _reset(self) -> None:
        """Forget the per-cycle structures (after the layout changed, or the files were closed)."""
        self._ids: list[ContainerIdentity] | None = None  # the identities the structures below were built for
        self._want_psi = False
        self._order: list[_Tracked] = []  # the containers of the row, in order
        self._row_keys: list[tuple[str, Mapping[str, str]]] = []  # and their series (Columns.keys)
        self._offsets: list[int] = []  # where each container's values start in the row
        self._values = np.zeros(0)  # the row, carried from cycle to cycle
        self._last_full = np.zeros(0, dtype=np.int64)  # cycle of each container's last full read
        self._pfds: list[int] = []  # the probe descriptors of every container, flat
        self._psize: list[int] = []  # the bytes asked of each (about twice what it held)
        self._ppaths: list[str] = []  # and their paths (templates: see OpenFiles.path_of)
        self._powner: list[int] = []  # and the index of their container in _order
        self._pstart: list[int] = [0]  # container i's probe descriptors are _pfds[_pstart[i]:_pstart[i + 1]]
        self._pprev: list[bytes | None] = []  # what they read last
        self._always: list[int] = []  # containers read in full every cycle (no probe: new, or files not kept)
        self._held = 0  # descriptors kept open
        self._snapshot: tuple[list[tuple[ContainerIdentity, ContainerStats]], float] = ([], 0.0)
        self._snap_order: list[_Tracked] | None = None  # the _order the snapshot's list was made for
        self._containers: dict[str, ContainerInfo] | None = {}

    def reconfigure(self, cfg: CgroupCollectorConfig) -> None:
        """A new runtime socket or refresh interval replaces the runtime-names client; the rest is read per run."""
        if (cfg.runtime_socket, cfg.names_refresh_seconds) != (self.cfg.runtime_socket,
                                                               self.cfg.names_refresh_seconds):
            if self.names is not None:
                self.names.close()
            self.names = runtime_names(cfg)
        self.cfg = cfg

    @property
    def containers(self) -> dict[str, ContainerInfo]:
        """Container id -> identity and stats as the last :meth:`collect` read them (built when asked; safe from
        other threads: each run replaces the snapshot it is built from)."""
        got = self._containers
        if got is None:
            infos, now = self._snapshot
            got = self._containers = {i.container_id: ContainerInfo(i, st, now) for i, st in infos}
        return got

    @property
    def refresh_cycles(self) -> int:
        """A container whose probe did not change is read in full at least once in this many runs."""
        return self.idle_refresh_runs(self.cfg.interval_seconds)

    def idle_refresh_runs(self, interval_seconds: float) -> int:
        """How many runs, at ``interval_seconds``, fit in ``idle_refresh_seconds``: what a collector reads of an
        idle container is read at least once in this many runs (1: every run). The perf and rdt collectors use
        it too."""
        return max(1, math.ceil(self.cfg.idle_refresh_seconds / interval_seconds - 1e-9))

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
            parts.append(f"{self.full_reads} of {len(self._order)} containers read in full in the last run "
                         f"(the others' CPU usage and cpuset unchanged; each is read in full at least every "
                         f"{self.refresh_cycles} runs)")
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
        """Descriptors kept open, as counted where files are opened and closed (no sum over the containers:
        :meth:`status` asks after every run)."""
        return self._held

    def collect(self, now: float) -> list[Sample]:
        return self.collect_row(now).samples()

    def collect_row(self, now: float) -> Columns:
        """Every container's series as one row of :class:`Columns`: the keys list is kept while the containers
        stay the same, so the store resolves series only on change; a container not read in full this run
        (see the class) keeps its values from the last run it was."""
        layout = detect_layout(self.cgroup_root)
        if layout is None:
            raise CollectorUnavailable(f"no cgroup hierarchy with CPU accounting under {self.cgroup_root}")
        if layout != self._layout:
            self._close_files()
            self._layout = layout
        self._version = layout.version
        if not self.kept_open_limit:
            self.kept_open_limit = max(0, raise_nofile(1 << 20) - FD_HEADROOM)
        self.cycle += 1
        cycle = self.cycle
        ids = self.identities(layout)
        want_psi = self.cfg.pressure and layout.unified is not None
        if ids != self._ids or want_psi != self._want_psi:
            self._rebuild(layout, ids, want_psi)
        if self._held > self.kept_open_limit:
            self._shed()  # the limit was lowered: stop keeping the last containers' files
        order = self._order
        every = self.refresh_cycles
        # 1. The probe: every container's CPU usage and cpuset, compared with the last read.
        todo: set[int] = set(self._always)
        got: list[bytes | None] = []
        sizes = self._psize
        redo_probe = False
        if self._pfds and every > 1:
            try:
                got = list(map(os.pread, self._pfds, sizes, repeat(0, len(sizes))))
                odd = any(map(eq, map(len, got), sizes))  # type: ignore[arg-type]
            except OSError:  # a cgroup removed before its event arrived: find which, its full read says how
                got = list(map(_pread_or_none, self._pfds, sizes))
                odd = True
            todo.update(compress(self._powner, map(ne, got, self._pprev)))
            if odd:  # unreadable, or as long as asked (the file grew): read in full, ask for more next time
                for o, b, size in zip(self._powner, got, sizes, strict=True):
                    if b is None or len(b) >= size:
                        todo.add(o)
                        redo_probe = True
            self._pprev = got
            # 2. The idle refresh: whoever was not read in full for ``every`` runs.
            todo.update(np.flatnonzero(cycle - self._last_full >= every).tolist())
        else:
            todo = set(range(len(order)))
        # 3. Full reads.
        pos = PROBE_POSITIONS[layout.version]
        limit = self.kept_open_limit
        values = self._values
        gone: list[int] = []
        fresh = False  # a container's stats changed in this run
        log_reads: list[str] | None = [] if self.read_log is not None else None
        if log_reads is not None:
            log_reads += [order[i].files.path_of(p) for i, p in zip(self._powner, self._ppaths, strict=True)] \
                if got else []
        pstart = self._pstart
        for i in sorted(todo):
            t = order[i]
            held = len(t.files.fds)
            probed: dict[int, bytes] = {}
            if got and t.probe:
                k, e = pstart[i], pstart[i + 1]
                probed = {j: b for j, b, size in zip(t.probe, got[k:e], sizes[k:e], strict=False)
                          if b is not None and len(b) < size}
            st = t.full_read(layout, probed)
            if log_reads is not None:
                # (a file that is absent fails to open in the floor reader too)
                log_reads += map(t.files.path_of, filter(None, t.rest if t.probe and len(probed) == len(t.probe)
                                                         else t.paths))
            off = self._offsets[i]
            self._held += len(t.files.fds) - held  # (before the gone check: the read may have opened files)
            if st is None:
                values[off:off + len(t.keys)] = np.nan
                gone.append(i)
                continue
            if self._held > limit:
                self._held -= len(t.files.fds)
                t.files.close()  # beyond the descriptor limit: this one is opened and closed every cycle
            if (len(t.files.fds) != held or not t.probe) and t.open_probe(pos) != t.probe:
                redo_probe = True  # files opened or closed: the probe descriptors change
            if st is t.stats:  # its files said what they said last time: its values stand
                t.last_full = self._last_full[i] = cycle
                continue
            fresh = True
            if t.stats is None:  # first read: spread the idle refreshes of containers found together
                t.last_full = cycle - i % every
            else:
                t.last_full = cycle
            self._last_full[i] = t.last_full
            t.stats = st
            # the cpuset's size only: a label listing the CPUs would make a new series at every cpuset change
            t.values = [*st[:6], len(st.cpuset) if st.cpuset is not None else None]
            if len(t.keys) > 7:
                t.values += st.psi_seconds
            values[off:off + len(t.keys)] = t.values
        if gone:
            for i in gone:
                t = order[i]
                self._held -= len(t.files.fds)
                t.files.close()
                if self._tracked.get(t.ident.container_id) is t:
                    del self._tracked[t.ident.container_id]
            self._ids = None  # rebuilt next run, without them
            redo_probe = True
        if redo_probe:
            self._build_probe(layout)
        self.full_reads = len(todo)
        if log_reads is not None and self.read_log is not None:
            self.read_log.append(log_reads)
        if fresh or gone or order is not self._snap_order:
            dead = set(gone)
            self._snapshot = ([(t.ident, t.stats) for i, t in enumerate(order)
                               if t.stats is not None and i not in dead], now)
            self._snap_order = order
        else:  # no container's stats changed: the same list, read now
            self._snapshot = (self._snapshot[0], now)
        self._containers = None
        return Columns(self._row_keys, values.copy())

    def _rebuild(self, layout: CgroupLayout, ids: list[ContainerIdentity], want_psi: bool) -> None:
        """The row's containers changed: track new ones, close the files of those gone, lay out the row."""
        tracked = self._tracked
        live: set[str] = set()
        order: list[_Tracked] = []
        for ident in ids:
            cid = ident.container_id
            if cid in live:
                continue  # the same id twice (an extra cgroup named like a container): one row slot
            live.add(cid)
            t = tracked.get(cid)
            if t is None or (t.ident is not ident and t.ident != ident) or (len(t.paths) > 5) != want_psi:
                if t is not None:
                    self._held -= len(t.files.fds)
                    t.files.close()
                t = tracked[cid] = _Tracked(ident, ident.labels(), _templates(layout, self.cfg.pressure),
                                            OpenFiles(_rel(ident.cgroup_path)))
            order.append(t)
        for cid in [c for c in tracked if c not in live]:
            t = tracked.pop(cid)
            self._held -= len(t.files.fds)
            t.files.close()
        self._ids, self._want_psi = ids, want_psi
        if len(order) != len(self._order) or any(a is not b for a, b in zip(order, self._order, strict=True)):
            self._order = order
            self._row_keys = [k for t in order for k in t.keys]  # a new list: the store re-resolves (cheaply)
            self._offsets = list(accumulate((len(t.keys) for t in order), initial=0))[:-1]
            self._values = np.array([v for t in order for v in (t.values or (None,) * len(t.keys))],
                                    dtype=np.float64)
            self._last_full = np.array([t.last_full for t in order], dtype=np.int64)
        self._build_probe(layout)

    def _build_probe(self, layout: CgroupLayout) -> None:
        """Lay out the probe descriptors of every container read in full before (whose files are kept open)."""
        pos = PROBE_POSITIONS[layout.version]
        fds: list[int] = []
        sizes: list[int] = []
        paths: list[str] = []
        owner: list[int] = []
        prev: list[bytes | None] = []
        start = [0]
        always: list[int] = []
        for i, t in enumerate(self._order):
            p = t.open_probe(pos) if t.stats is not None else ()
            if p != t.probe:
                t.set_probe(p)
            if not p:
                always.append(i)
            for j in p:
                fds.append(t.files.fds[t.paths[j]])
                paths.append(t.paths[j])
                owner.append(i)
                prev.append(t.seen.get(j))
                sizes.append(_ask(len(t.seen.get(j, b""))))
            start.append(len(fds))
        self._pfds, self._ppaths, self._powner, self._pprev, self._pstart = fds, paths, owner, prev, start
        self._psize = sizes
        self._always = always

    def _shed(self) -> None:
        """Close the files of containers from the end of the row until the descriptors fit the limit."""
        for t in reversed(self._order):
            if self._held <= self.kept_open_limit:
                break
            if t.files.fds:
                self._held -= len(t.files.fds)
                t.files.close()
        if self._layout is not None:
            self._build_probe(self._layout)

    def cpusets(self) -> dict[str, frozenset[int]]:
        """Container id -> effective cpuset, as the last :meth:`collect` read them (the CPU lists are not in
        the store: a label holding them would churn series). The cpuset is part of the probe read every run."""
        return {cid: i.stats.cpuset for cid, i in self.containers.items() if i.stats.cpuset is not None}

    def _close_files(self) -> None:
        for t in self._tracked.values():
            t.files.close()
        self._tracked.clear()
        self._reset()

    def close(self) -> None:
        self._close_files()
        with self._lock:
            for d in self._discovery.values():
                d.close()
            self._discovery.clear()
        if self.names is not None:
            self.names.close()


def _pread_or_none(fd: int, size: int) -> bytes | None:
    try:
        return os.pread(fd, size, 0)
    except OSError:
        return None
