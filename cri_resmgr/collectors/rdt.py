"""Per-container memory bandwidth (RDT MBM) and LLC occupancy (RDT CMT) through resctrl.

Follows Documentation/arch/x86/resctrl.rst (Documentation/filesystems/resctrl.rst since 6.16):

- one MON group per container, ``<ctrl>/mon_groups/cri-resmgr.<container id>``, under the CTRL_MON group
  holding the container's threads (its RDT class, or the root) unless ``control_group`` names one; a MON
  group's ``tasks`` only takes tasks of its parent CTRL_MON group ("the task must already belong to the
  CTRL_MON parent of this group"), so a class change (EINVAL on a task write) moves the group.
- its ``tasks`` are synced every run from the container's cgroup (v2 ``cgroup.threads``, v1 ``tasks``):
  resctrl tracks *threads*, and a new thread inherits its creator's group at clone, so only threads that
  existed before their container was synced need writing. One thread id per write.
- counters: ``mon_data/mon_L3_XX/{mbm_total_bytes,mbm_local_bytes,llc_occupancy}`` where XX is the L3
  cache id; a read gives a decimal value, ``Unavailable`` (no valid count yet: a fresh RMID, or after an
  MBM event reconfiguration), ``Error`` (the hardware reported an error) or, with MBM counter assignment
  (6.17+), ``Unassigned``. With SNC the ``mon_L3_XX`` files are the sums of the ``mon_sub_L3_YY`` nodes,
  so they are what is read.
- only the events listed in ``info/L3_MON/mon_features`` are read: MBM-only, CMT-only and allocation-only
  (MBA/CAT without monitoring) systems all work; without ``info/L3_MON`` the collector is down with that
  reason.
- ``mkdir`` fails with ENOSPC when RMIDs run out ("creation of MON group may fail if we run out of
  RMIDs") or EBUSY while freed RMIDs are still in limbo; those containers are reported as unmonitored.
- every failed mkdir/rmdir/write is reported with the text of ``info/last_cmd_status``.
- node totals per L3 domain: the sum over CTRL_MON groups (the root and the top-level directories),
  because "in CTRL_MON groups these files provide the sum for all tasks in the CTRL_MON group and all
  tasks in MON groups".

Counter width: the kernel reads the hardware MBM counter (24 bits on Broadwell..Cascade Lake, 24 plus
the CPUID.0xF.1:EAX offset since Ice Lake, in units of the upscaling factor) and extends it, every
second from its overflow worker, into a 64-bit byte count (arch/x86/kernel/cpu/resctrl/monitor.c,
``mbm_overflow_count``). The file therefore only wraps at 2^64, which is the default
``mbm_counter_width_bits``; set a smaller width for kernels that show the raw hardware width. A value
below the previous one is a wrap when the width is < 64, and a reset (group recreated, counters
cleared) at 64.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import eq, is_
from pathlib import Path

import numpy as np

from .. import metrics as M
from ..config import RdtCollectorConfig
from ..store import Columns, LabelSet, Sample
from ..sysfs import read_int, read_text
from .base import Collector, CollectorUnavailable, Probe
from .cgroup import _REL, CgroupCollector, CgroupLayout, OpenFiles, _ask, _Gone, _paths, _pread_or_none, detect_layout
from .identity import ContainerIdentity, short_name

log = logging.getLogger(__name__)

GROUP_PREFIX = "cri-resmgr."
MBM_FILES = {"mbm_total_bytes": "total", "mbm_local_bytes": "local"}
OCCUPANCY_FILE = "llc_occupancy"
NOT_COUNTS = ("Unavailable", "Error", "Unassigned")
# Bytes asked of a counter file: a 64-bit decimal value or one of NOT_COUNTS and a newline fit; a longer text
# is read again whole.
COUNTER_READ_SIZE = 64
RESERVED_DIRS = {"info", "mon_groups", "mon_data"}
RMID_RETRY_SECONDS = 30.0
# RMIDs in limbo are freed when the kernel's limbo worker sees their occupancy drop (every second or so).
LIMBO_RETRY_SECONDS = 1.0
# Reading a group's ``tasks`` walks every thread on the machine (rdtgroup_tasks_show loops over all
# threads), so the collector trusts its own record of what it wrote and re-reads the file only this often
# (to see tasks that someone else moved away).
TASKS_VERIFY_SECONDS = 60.0
# What changes only when resctrl or the cgroup tree is remounted or a CTRL_MON group is made or removed (the
# info/ files, the L3 domains, the cgroup layout, the CTRL_MON groups, which of our MON groups still exist) is
# looked at again this often, and at once when a kept-open counter file of ours reports its group gone.
STATIC_REFRESH_SECONDS = 30.0
# The idle refresh of a container whose CPU usage stood still since its counters were read (every refresh_runs
# runs) reads its llc_occupancy files, which can drop while it sleeps (others evict its lines), and its MBM
# counters only every this many refreshes: MBM counts only while the RMID is loaded on a CPU, i.e. while a task of
# the group runs (resctrl.rst, "RMID"; resctrl_sched_in at context switch), so they stand; the MBM read now and
# then bounds how long bytes attributed otherwise would wait (none is lost: the next read's delta counts them).
# On resctrl each counter read is an IPI to a CPU of the domain: at 1,000 containers this cuts the counter reads
# of a run about in half.
MBM_IDLE_REFRESHES = 4
# Unmonitored for now because its CPU usage stood still since it was watched or first seen: nothing to count
# (MBM counts only while its tasks run); it goes first in the rotation once it runs.
IDLE_REASON = "idle: did not run since watched or first seen"
# A container holding a ranked MON group keeps it at a re-ranking unless a challenger in the same priority and QoS
# tier uses at least this many times its CPU and this much more (CPU seconds a second): CPU use of containers near
# each other in the ranking swaps places from slice to slice, and each swap costs an rmdir, a mkdir, a tasks
# write and a baseline read, and a gap in both containers' counts.
RANK_KEEP_RATIO = 1.25
RANK_KEEP_MARGIN_CPU = 0.05


@dataclass(frozen=True)
class MonValue:
    value: int | None
    status: str  # "ok", "Unavailable", "Error", "Unassigned", "missing", "malformed"


def parse_mon_value(text: str | None) -> MonValue:
    if text is None:
        return MonValue(None, "missing")
    t = text.strip()
    if t in NOT_COUNTS:
        return MonValue(None, t)
    try:
        v = int(t)
    except ValueError:
        return MonValue(None, "malformed")
    return MonValue(v, "ok") if v >= 0 else MonValue(None, "malformed")


@dataclass(frozen=True)
class ResctrlInfo:
    mounted: bool
    monitoring: bool
    features: frozenset[str]
    num_rmids: int | None
    resources: tuple[str, ...]  # info/ subdirectories: L3, L2, MB, L3_MON, ...


def parse_mon_features(text: str) -> frozenset[str]:
    """``info/L3_MON/mon_features``: one event per line; ``*_config`` lines (BMEC) are not events."""
    return frozenset(ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().endswith("_config"))


def read_info(root: Path) -> ResctrlInfo:
    info = Path(root) / "info"
    if not info.is_dir():
        return ResctrlInfo(False, False, frozenset(), None, ())
    try:
        resources = tuple(sorted(e.name for e in os.scandir(info) if e.is_dir()))
    except OSError:
        resources = ()
    mon = info / "L3_MON"
    if not mon.is_dir():
        return ResctrlInfo(True, False, frozenset(), None, resources)
    return ResctrlInfo(True, True, parse_mon_features(read_text(mon / "mon_features") or ""),
                       read_int(mon / "num_rmids"), resources)


def counter_delta(prev: int, cur: int, width_bits: int) -> int:
    """Bytes counted between two reads of an MBM file that wraps at ``2**width_bits``."""
    if cur >= prev:
        return cur - prev
    if width_bits < 64:
        return cur + (1 << width_bits) - prev
    return cur  # reset: the group was recreated or its counters cleared


@dataclass
class Counter:
    last_raw: int | None = None
    total: int = 0

    def advance(self, raw: int, width_bits: int) -> int:
        if self.last_raw is None:
            self.total = raw
        else:
            self.total += counter_delta(self.last_raw, raw, width_bits)
        self.last_raw = raw
        return self.total


@dataclass(frozen=True)
class RdtIssue:
    container_id: str
    operation: str  # mkdir, rmdir, write tasks
    path: str
    error: str  # strerror
    last_cmd_status: str

    def __str__(self) -> str:
        return f"{self.operation} {self.path}: {self.error}; last_cmd_status: {self.last_cmd_status}"


@dataclass
class MonGroup:
    ident: ContainerIdentity
    path: Path
    synced: set[int] = field(default_factory=set)  # thread ids known to be in the group
    verified_at: float | None = None
    files: OpenFiles = field(default_factory=OpenFiles)  # its counters and the container's thread list, kept open
    misplaced: bool = False  # a task write said the threads are in another CTRL_MON group (a class change)
    usage: bytes | None = None  # the container's CPU usage file as it read at the group's last counter read
    idle_runs: int = 0  # runs since that read (the counters not read: the container did not run)
    read_at: float = 0.0  # the time of that read
    occupancy: list[tuple[tuple[str, Mapping[str, str]], float]] = field(default_factory=list)  # as last read
    usage_path: str = ""  # the container's CPU usage file ("" until known for the current cgroup layout)
    threads_path: str = ""  # its thread list, likewise
    # (file, cache id, path) read every cycle; the paths are templates (``_REL`` for the group's directory, which
    # ``files`` puts in to open them), one list shared by every group with the same domains and files
    reads: list[tuple[str, int, str]] | None = None
    read_fds: list[int] | None = None  # their descriptors, once all are open
    still_refreshes: int = 0  # idle refreshes in a row that read its occupancy alone (see MBM_IDLE_REFRESHES)

    @property
    def ctrl(self) -> Path:
        return self.path.parent.parent

    def occupancy_reads(self) -> tuple[list[tuple[str, int, str]], list[int] | None]:
        """Its occupancy files alone, as (reads, their kept descriptors or None): what the idle refresh of a
        container that did not run reads (its MBM counters stand, see RdtCollector._collect)."""
        reads = self.reads or []
        at = [j for j, r in enumerate(reads) if r[0] == OCCUPANCY_FILE]
        fds = self.read_fds
        return [reads[j] for j in at], None if fds is None else [fds[j] for j in at]


@dataclass
class Watch:
    """What is known of one container's traffic across the MON groups it had (rotation makes and removes
    them): bytes seen while watched, and for how long it was watched."""

    ident: ContainerIdentity
    observed: dict[tuple[str, int], int] = field(default_factory=dict)  # (file, cache id) -> bytes seen
    last_raw: dict[tuple[str, int], int] = field(default_factory=dict)  # of the current group
    exported: dict[tuple[str, int], float] = field(default_factory=dict)  # last estimate (kept monotonic)
    first_read: float | None = None
    last_read: float | None = None  # previous read of the current group; None: the next read is a baseline
    watched_seconds: float = 0.0
    gaps: bool = False  # unwatched for some time since the first read: estimates are scaled
    last_watched: float = float("-inf")  # for rotation: the least recently watched go first
    reason: str = ""
    # While it has no group: its CPU usage as the cgroup collector last read it and the time from which it is
    # known to have stood still (None: unknown), and whether it ran while unwatched (bytes not seen).
    idle_usage: float | None = None
    idle_at: float = 0.0
    ran_unwatched: bool = False
    _labels: dict[tuple[str, str], Mapping[str, str]] = field(default_factory=dict)  # built once, reused
    _keys: dict[tuple[str, str, str], tuple[str, Mapping[str, str]]] = field(default_factory=dict)  # likewise
    # (key in observed, its bandwidth series key), in the order of observed; rebuilt when observed grows
    _bw: list[tuple[tuple[str, int], tuple[str, Mapping[str, str]]]] = field(default_factory=list)

    def rename(self, ident: ContainerIdentity) -> None:
        """The container's names arrived from the runtime: its series keys are made again."""
        self.ident, self._labels, self._keys, self._bw = ident, {}, {}, []

    def bandwidth_items(self) -> list[tuple[tuple[str, int], tuple[str, Mapping[str, str]]]]:
        if len(self._bw) != len(self.observed):
            self._bw = [(k, self.bandwidth_key(k)) for k in self.observed]
        return self._bw

    def labels_with(self, k: str, v: str) -> Mapping[str, str]:
        lab = self._labels.get((k, v))
        if lab is None:
            base = self.ident.labels()
            lab = self._labels[(k, v)] = LabelSet({**base, k: v}) if k else base
        return lab

    def key(self, metric: str, k: str, v: str) -> tuple[str, Mapping[str, str]]:
        """The series key ``(metric, labels)`` with one extra label (none when ``k`` is ""), the same tuple
        object every run (the store's column plan is matched by identity)."""
        got = self._keys.get((metric, k, v))
        if got is None:
            got = self._keys[(metric, k, v)] = (metric, self.labels_with(k, v))
        return got

    def bandwidth_key(self, key: tuple[str, int]) -> tuple[str, Mapping[str, str]]:
        """The key of the bandwidth series of ``(file, cache id)``, the same tuple every run."""
        got = self._keys.get((M.CONTAINER_MEMORY_BANDWIDTH.name, key[0], str(key[1])))
        if got is None:
            got = self._keys[(M.CONTAINER_MEMORY_BANDWIDTH.name, key[0], str(key[1]))] = (
                M.CONTAINER_MEMORY_BANDWIDTH.name, self.bandwidth_labels(key))
        return got

    def bandwidth_labels(self, key: tuple[str, int]) -> Mapping[str, str]:
        k = ("scope/cache_id", f"{MBM_FILES[key[0]]}/{key[1]}")
        lab = self._labels.get(k)
        if lab is None:
            lab = self._labels[k] = LabelSet({**self.ident.labels(), "scope": MBM_FILES[key[0]],
                                              "cache_id": str(key[1])})
        return lab

    def lost_group(self, usage: float | None = None, at: float = 0.0) -> None:
        """Its group is gone; ``usage`` is its CPU usage as last read (at or before ``at``, the loss), the
        base from which standing still counts as watched (see :meth:`RdtCollector._credit_idle`)."""
        self.last_raw.clear()
        if self.last_read is not None:
            self.gaps = True
        self.last_read = None
        self.idle_usage, self.idle_at = usage, at

    def regrouped(self) -> None:
        """A new group: a new RMID whose first read is a baseline; it is watched again."""
        self.lost_group()
        self.ran_unwatched = False

    def credit_idle(self, usage: float | None, at: float) -> bool:
        """The cgroup collector read ``usage`` at ``at`` while the container had no group. If it stands where
        it stood at :attr:`idle_at`, no task of the container ran in between, and MBM counts only while a
        task's RMID is loaded on a CPU, i.e. while it runs (resctrl.rst, "RMID"; the RMID is switched in at
        context switch, resctrl_sched_in): those seconds counted zero bytes, as surely as if watched, and are
        added to the watched time. Otherwise they are not (the bytes are unknown) and the container is due a
        group. True when the watched time grew."""
        if usage is None or self.idle_usage is None or usage != self.idle_usage:
            self.ran_unwatched = True  # it ran since the base (or there is none: it may have)
            self.idle_usage, self.idle_at = usage, max(at, self.idle_at)
            return False
        if at <= self.idle_at or self.first_read is None:
            return False
        self.watched_seconds += at - self.idle_at
        self.idle_at = at
        return True


# An extrapolated estimate (a container not watched all along) is kept in units of a power of two bytes of at most
# 1/ESTIMATE_UNIT_SHARE of its bytes per watched second, ~0.8 % of a 1 s run's growth: see estimate_bytes.
ESTIMATE_UNIT_SHARE = 128


def estimate_bytes(seen: np.ndarray, scale: np.ndarray, watched: np.ndarray) -> np.ndarray:
    """``seen`` bytes scaled by ``scale`` (elapsed / watched seconds, 1 for a container watched all along), in
    whole bytes: what a watched container's groups counted, exactly. An extrapolated one (scale > 1) grows every
    run by seen / watched × the run's elapsed time, which jitters by the thread's wake-up (~0.1-1 ms in 2 s): in
    whole bytes those steps differ in their low bytes from run to run, and the store's codec keeps two or more
    bytes a row for them. Rounded down to a unit of a power of two no larger than 1/ESTIMATE_UNIT_SHARE of the
    container's bytes per watched second, the steps differ by a few units, a byte a row (tests/test_rdt.py), and
    the estimate moves by less than 1 % of one second's growth: far inside what extrapolating from the watched
    time can know."""
    est = np.floor(seen * scale)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rate = np.where(watched > 0, seen / watched, 0.0)
        unit = np.where((scale > 1.0) & (rate >= 2 * ESTIMATE_UNIT_SHARE),
                        np.exp2(np.floor(np.log2(np.maximum(rate, 1.0) / ESTIMATE_UNIT_SHARE))), 1.0)
    return np.floor(est / unit) * unit


@dataclass
class _Row:
    """The collector's row (:class:`Columns`), laid out for the MON groups, watches and unmonitored containers
    of a run and kept, with its keys list, while they and their series stay the same. A run writes what it
    read into it, and the bandwidth estimates as one vector operation: every container ever watched has its
    estimates written every run, and those of a container not watched all along change every run (scaled by
    elapsed / watched time)."""

    keys: list[tuple[str, Mapping[str, str]]]
    values: np.ndarray
    groups: list[str]  # the containers with a MON group, as laid out
    wids: list[str]  # the containers with a watch, as laid out
    watches: list[Watch]  # and their watches
    widx: dict[str, int]  # container id -> index of its watch
    occ_at: dict[str, int]  # container id -> where its group's occupancy series start
    est_at: dict[str, tuple[int, int]]  # container id -> (start, count) of its estimates in the arrays below
    est_slot: np.ndarray  # per estimate: its position in the row
    est_w: np.ndarray  # its watch
    obs: np.ndarray  # the bytes seen (Watch.observed)
    exp: np.ndarray  # the last estimate written (kept monotonic)
    ms_slot: np.ndarray  # the monitored-seconds series' positions
    ms_w: np.ndarray  # and their watches
    first: np.ndarray  # per watch: Watch.first_read (NaN: None)
    seconds: np.ndarray  # Watch.watched_seconds
    gaps: np.ndarray  # Watch.gaps
    unmon_at: int  # where the unmonitored containers' series start (the tail of the row: see with_unmonitored)
    tail_at: int  # where the node-level series start
    tail_keys: list[tuple[str, Mapping[str, str]]]
    unmonitored: dict[str, tuple[ContainerIdentity, str]]  # as laid out

    def read(self, cid: str, w: Watch, occupancy: list[tuple[tuple[str, Mapping[str, str]], float]]) -> None:
        """The counters of ``cid``'s group were read (its series the same as laid out)."""
        at = self.occ_at[cid]
        for k, (_key, v) in enumerate(occupancy):
            self.values[at + k] = v
        got = self.est_at.get(cid)
        if got is not None:
            self.obs[got[0]:got[0] + got[1]] = list(w.observed.values())

    def fill(self, now: float, tail_values: list[float]) -> Columns:
        """The estimates: bytes over the container's whole observed life, what was seen scaled by elapsed /
        watched time when it was not watched all along (as perf scales multiplexed counts by enabled /
        running), rounded down to whole bytes (:func:`estimate_bytes`), never below what was written before."""
        values = self.values
        if len(self.est_slot):
            ws = self.seconds
            with np.errstate(divide="ignore", invalid="ignore"):
                scale = np.where(self.gaps & (ws > 0), np.maximum(1.0, (now - self.first) / ws), 1.0)
            self.exp = np.maximum(estimate_bytes(self.obs, scale[self.est_w], ws[self.est_w]), self.exp)
            values[self.est_slot] = self.exp
        if len(self.ms_slot):
            # Exported in whole milliseconds: the store codes a series of exact k / 1000 values as its steps (about
            # a byte a row for a watched container) where the float sums of run intervals take ~5 bytes a row (at
            # 1,000 containers, ~4 MiB of the store at full retention). The estimates above use the exact sums.
            values[self.ms_slot] = np.round(self.seconds[self.ms_w], 3)
        values[self.tail_at:] = tail_values
        return Columns(self.keys, values.copy())

    def with_unmonitored(self, keys: list[tuple[str, Mapping[str, str]]], values: list[float],
                         tail_keys: list[tuple[str, Mapping[str, str]]],
                         unmonitored: dict[str, tuple[ContainerIdentity, str]]) -> _Row:
        """This row with its unmonitored containers' and node-level series (the end of the row) replaced by
        ``keys`` and ``values``, which list the unmonitored series then ``tail_keys``: the groups' and watches'
        part, and its arrays, stand (a reason that changed without a group changing hands, every few runs at
        1,000 containers, costs no layout of every watch)."""
        head = self.keys[:self.unmon_at]
        return replace(self, keys=head + keys,
                       values=np.concatenate((self.values[:self.unmon_at], np.array(values, dtype=np.float64))),
                       tail_at=self.unmon_at + len(keys) - len(tail_keys), tail_keys=tail_keys,
                       unmonitored=dict(unmonitored))

    def save(self) -> None:
        """Keep the estimates written into the watches (the next layout starts from them)."""
        exp = self.exp.tolist()
        for cid, (start, count) in self.est_at.items():
            w = self.watches[self.widx[cid]]
            for k, key in enumerate(list(w.observed)[:count]):
                w.exported[key] = exp[start + k]


def _read_or_none(files: OpenFiles, path: str) -> bytes | None:
    try:
        return files.read(path)
    except _Gone:
        return None


def read_small(path: Path) -> str | None:
    """One small kernel file, with plain syscalls (cheaper than Path.read_text for hundreds of files a
    run); None when it is absent or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # A short read is the whole file: resctrl and cgroup files are seq_files that return everything
        # they have in the first read when it fits (fs/seq_file.c); only a full buffer needs another read.
        chunks = [os.read(fd, 65536)]
        while len(chunks[-1]) == 65536:
            chunks.append(os.read(fd, 65536))
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def parse_ids(text: str | None) -> set[int]:
    out = set()
    for tok in (text or "").split():
        try:
            out.add(int(tok))
        except ValueError:
            continue
    return out


def container_threads(layout: CgroupLayout, rel: str) -> set[int] | None:
    """Thread ids of a container cgroup (cgroup-v2.rst ``cgroup.threads``; cgroup-v1/cgroups.rst ``tasks``);
    None when the cgroup is gone."""
    rel = rel.strip("/")
    if layout.version == 2:
        d = layout.root / rel
        text = read_small(d / "cgroup.threads")
        if text is None:
            text = read_small(d / "cgroup.procs")
    else:
        text = read_small(layout.root / rel / "tasks")
    return None if text is None else parse_ids(text)


class RdtCollector(Collector):
    name = "rdt"

    def __init__(self, resctrl_root: Path, cgroup_root: Path, cfg: RdtCollectorConfig | None = None,
                 discovery: CgroupCollector | None = None, clock=time.monotonic):
        self.root = Path(resctrl_root)
        self.cgroup_root = Path(cgroup_root)
        self.cfg = cfg or RdtCollectorConfig()
        self.discovery = discovery or CgroupCollector(self.cgroup_root)
        self.clock = clock
        self.groups: dict[str, MonGroup] = {}
        self.unmonitored: dict[str, tuple[ContainerIdentity, str]] = {}  # id -> (identity, reason)
        self.issues: list[RdtIssue] = []  # of the last run
        self.readings: dict[str, int] = {}  # status -> count, last run (Unavailable, Error, ...)
        self.write_errors_total = 0
        self.info: ResctrlInfo | None = None
        self._cleaned = False
        self._rmid_exhausted_at: float | None = None
        self._exhausted_reason = "no free RMID"
        self._node: dict[tuple[str, str, int], Counter] = {}  # (ctrl group, file, cache id)
        self.watches: dict[str, Watch] = {}  # container id -> what is known of it across its MON groups
        self.capacity: int | None = None  # MON groups the agent can hold (None: every container fits)
        self._learned_capacity: int | None = None  # groups held when mkdir last failed for want of RMIDs
        self._learned_at = 0.0
        self._slice: int | None = None  # index of the current rotation slice
        self._desired: dict[str, str] = {}  # container id -> why it is monitored in this slice
        self._cpu: dict[str, tuple[float, float]] = {}  # container id -> (time, cpu seconds), for ranking
        self._cpu_rate: dict[str, float] = {}
        self._tid_ctrl: dict[int, Path] | None = None  # thread -> CTRL_MON group, read at most once a run
        self._row_keys: list[tuple[str, Mapping[str, str]]] = []  # the last row's keys (Columns.keys)
        self.idle_groups = 0  # groups whose counters the last run did not read (their container did not run)
        # Files read by each run, one list per run, when a list (the benchmark's C floor reads the same).
        self.read_log: list[list[str]] | None = None
        self._keys: dict[tuple[str, tuple], tuple[str, Mapping[str, str]]] = {}  # node-level series keys
        # (container id, reason) -> (key of its rdt_monitored 0 series, the identity it was made for)
        self._unmonitored_keys: dict[tuple[str, str], tuple[tuple[str, Mapping[str, str]], ContainerIdentity]] = {}
        # What is looked at again only every STATIC_REFRESH_SECONDS (or when a group of ours went missing):
        # (resctrl info, cgroup layout, L3 domain ids), and when that was read.
        self._static: tuple[ResctrlInfo, CgroupLayout, list[int]] | None = None
        self._static_at = 0.0
        self._recheck = False  # a kept-open counter file said its group is gone: look again next run
        self._node_reads: list[tuple[str, str, int, str]] = []  # (ctrl group, file, cache id, path): node totals
        self._node_files = OpenFiles()  # those files, kept open
        self._reads_of: dict[tuple[tuple[int, ...], tuple[str, ...]], list[tuple[str, int, str]]] = {}
        self._node_group: MonGroup | None = None  # and as a group's reads, read with the groups' (_read_counters)
        self._codes: dict[str, str] = {}  # unmonitored reason -> its rdt_monitored reason label
        self._row: _Row | None = None  # the last run's row, kept while its series stay the same
        self._probe: tuple[list[MonGroup], list[int], list[int]] | None = None  # see _make_probe
        self._dirty = False  # a watch lost its group or was renamed in this run: lay the row out again
        # Containers never watched: their CPU usage when first seen, and whether it moved since (see _credit_idle)
        self._unseen: dict[str, tuple[float, bool]] = {}
        # Per-run work on every container kept down (1,000 containers, a run every 2 s): refresh_runs as of this
        # run, the cgroup collector's snapshot _credit_idle last went through and its usages, the RMIDs of the
        # others' groups as last counted and when, and each container's (identity, priority, QoS rank).
        self._every: int | None = None
        self._credit_infos: object = None
        self._credit_usages: dict[str, float] = {}
        self._others: tuple[float, int] | None = None
        self._tier: dict[str, tuple[ContainerIdentity, bool, int]] = {}
        self._lock = threading.Lock()

    def reconfigure(self, cfg: RdtCollectorConfig) -> None:
        """Apply a reloaded configuration (called from the reload thread, hence the lock)."""
        with self._lock:
            if cfg.control_group != self.cfg.control_group or not cfg.enabled:
                self._close()
                self._cleaned = False
            self.cfg = cfg
            self._static = None
            self._tier = {}  # priority selectors and QoS order may have changed

    @property
    def control_dir(self) -> Path:
        return self.root / self.cfg.control_group.strip("/") if self.cfg.control_group else self.root

    def ctrl_groups(self) -> list[Path]:
        out = [self.root]
        try:
            for e in sorted(os.scandir(self.root), key=lambda e: e.name):
                if e.is_dir() and e.name not in RESERVED_DIRS:
                    out.append(Path(e.path))
        except OSError:
            pass
        return out

    # -- probe -------------------------------------------------------------------------------------
    def _availability(self) -> ResctrlInfo:
        info = read_info(self.root)
        if not info.mounted:
            raise CollectorUnavailable(f"resctrl is not mounted at {self.root} (no info/ directory; "
                                       "mount -t resctrl resctrl /sys/fs/resctrl, needs RDT in CPU and kernel)")
        if not info.monitoring:
            raise CollectorUnavailable(
                f"resctrl at {self.root} has no L3 monitoring (info/L3_MON absent; resources: "
                f"{', '.join(info.resources) or 'none'}): allocation only, nothing to measure")
        wanted = set(MBM_FILES) | {OCCUPANCY_FILE}
        if not info.features & wanted:
            raise CollectorUnavailable(f"info/L3_MON/mon_features lists none of {', '.join(sorted(wanted))}")
        return info

    def probe(self) -> Probe:
        static = self._static
        if static is not None and not self._recheck and self.clock() - self._static_at < STATIC_REFRESH_SECONDS:
            # Looked at within STATIC_REFRESH_SECONDS and every read since went through: resctrl is as it was
            # (a failed read sets _recheck, and the next probe looks again).
            return Probe(True, self.summary(static[0]))
        try:
            info = self._availability()
        except CollectorUnavailable as e:
            return Probe(False, str(e))
        return Probe(True, self.summary(info))

    def status(self) -> str | None:
        return self.summary()

    def summary(self, info: ResctrlInfo | None = None) -> str:
        info = info or self.info
        feats = ", ".join(sorted(info.features)) if info else "?"
        parts = [f"monitoring {len(self.groups)} containers in {self.control_dir / 'mon_groups'} "
                 f"(features: {feats}; RMIDs: {info.num_rmids if info else '?'})"]
        if self.unmonitored:
            names = [f"{short_name(i)} ({r})" for i, r in list(self.unmonitored.values())[:5]]
            more = f" and {len(self.unmonitored) - 5} more" if len(self.unmonitored) > 5 else ""
            parts.append(f"unmonitored {len(self.unmonitored)}: {', '.join(names)}{more}")
        bad = {k: v for k, v in self.readings.items() if k != "ok"}
        if bad:
            parts.append("readings not counted: " + ", ".join(f"{v} {k}" for k, v in sorted(bad.items())))
        if self.issues:
            more = f" (+{len(self.issues) - 1} more)" if len(self.issues) > 1 else ""
            parts.append(f"errors: {self.issues[0]}{more}")
        return "; ".join(parts)

    # -- resctrl operations, each failure reporting last_cmd_status -----------------------------------
    def last_cmd_status(self) -> str:
        return (read_text(self.root / "info" / "last_cmd_status") or "").strip() or "(empty)"

    def _issue(self, ident: ContainerIdentity | None, op: str, path: Path, e: OSError) -> RdtIssue:
        issue = RdtIssue(ident.container_id if ident else "", op, str(path), e.strerror or str(e),
                         self.last_cmd_status())
        self.issues.append(issue)
        self.write_errors_total += 1
        log.warning("resctrl: %s", issue)
        return issue

    def _ctrl_of(self, layout: CgroupLayout, ident: ContainerIdentity) -> Path:
        """The CTRL_MON group that holds the container's threads: ``control_group`` when configured, else the
        group whose ``tasks`` lists the container's first thread (an RDT class puts them in
        ``<resctrl>/<class>``; a MON group only takes tasks of its parent). The others' ``tasks`` are read
        at most once per run, and only when a group is to be made (each read walks every thread)."""
        if self.cfg.control_group:
            return self.control_dir
        tids = container_threads(layout, ident.cgroup_path) or set()
        if not tids:
            return self.root
        if self._tid_ctrl is None:
            self._tid_ctrl = {}
            for ctrl in self.ctrl_groups()[1:]:  # the root group's tasks are everyone else
                for tid in parse_ids(read_small(ctrl / "tasks")):
                    self._tid_ctrl[tid] = ctrl
        return self._tid_ctrl.get(min(tids), self.root)

    def _mkdir(self, ident: ContainerIdentity, ctrl: Path | None = None) -> MonGroup | None:
        path = (ctrl or self.control_dir) / "mon_groups" / (GROUP_PREFIX + ident.container_id)
        try:
            os.mkdir(path)
        except FileExistsError:
            return MonGroup(ident, path)
        except OSError as e:
            issue = self._issue(ident, "mkdir", path, e)
            if e.errno in (errno.ENOSPC, errno.EBUSY):
                self._rmid_exhausted_at = self.clock()
                if e.errno == errno.ENOSPC:
                    self._learned_capacity, self._learned_at = len(self.groups), self.clock()
                else:  # EBUSY: freed RMIDs still in limbo, free again soon: retry after LIMBO_RETRY_SECONDS
                    self._rmid_exhausted_at -= RMID_RETRY_SECONDS - LIMBO_RETRY_SECONDS
                kind = "no free RMID" if e.errno == errno.ENOSPC else "RMIDs busy in limbo"
                self._exhausted_reason = f"{kind}: {issue.last_cmd_status}"
                self.unmonitored[ident.container_id] = (ident, self._exhausted_reason)
            else:
                self.unmonitored[ident.container_id] = (ident, f"mkdir failed: {issue.error}; {issue.last_cmd_status}")
            return None
        # A group just made holds no task (resctrl.rst: "tasks" of a new group is empty): nothing to read back
        # before the first sync writes the container's threads.
        return MonGroup(ident, path, verified_at=self.clock())

    def _rmdir(self, g: MonGroup) -> None:
        g.files.close()
        try:
            os.rmdir(g.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._issue(g.ident, "rmdir", g.path, e)

    @property
    def refresh_runs(self) -> int:
        """Counters of a group whose container did not run are read at least once in this many runs: the
        cgroup collector's ``idle_refresh_seconds`` over this collector's interval (1: read every run)."""
        return self.discovery.idle_refresh_runs(self.cfg.interval_seconds)

    def _usage(self, layout: CgroupLayout, g: MonGroup) -> tuple[str, bytes | None]:
        """The container's CPU usage file (cpuacct.usage, v2 cpu.stat), kept open, and its text now."""
        path = g.usage_path
        if not path:
            path = g.usage_path = _paths(layout, g.ident.cgroup_path, False)[0]
        try:
            return path, g.files.read(path)
        except _Gone:
            return path, None

    @staticmethod
    def _threads_path(layout: CgroupLayout, g: MonGroup) -> str:
        if not g.threads_path:
            rel = g.ident.cgroup_path.strip("/")
            g.threads_path = (f"{layout.root}/{rel}/cgroup.threads" if layout.version == 2
                              else f"{layout.root}/{rel}/tasks")
        return g.threads_path

    def _sync_tasks(self, layout: CgroupLayout, g: MonGroup) -> None:
        try:
            text = g.files.read(self._threads_path(layout, g))
        except _Gone:
            return
        want = parse_ids(text.decode()) if text is not None else container_threads(layout, g.ident.cgroup_path)
        if not want:
            return
        now = self.clock()
        if g.verified_at is None or now - g.verified_at >= TASKS_VERIFY_SECONDS:
            g.synced = parse_ids(read_small(g.path / "tasks"))
            g.verified_at = now
        g.synced &= want  # threads that exited or left the container
        missing = sorted(want - g.synced)
        if not missing:
            return
        path = g.path / "tasks"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as e:
            self._issue(g.ident, "open", path, e)
            return
        try:
            for tid in missing:
                try:
                    os.write(fd, f"{tid}\n".encode())
                    g.synced.add(tid)
                except ProcessLookupError:
                    continue  # the thread exited between the two reads
                except OSError as e:
                    self._issue(g.ident, f"write task {tid} to", path, e)
                    if e.errno == errno.EINVAL and not self.cfg.control_group:
                        g.misplaced = True  # moved to another class: the group follows next run
                    break  # the rest would fail the same way (e.g. a foreign CTRL_MON group)
        finally:
            os.close(fd)

    def _cleanup_stale(self, live: dict[str, ContainerIdentity]) -> None:
        """At start: adopt our groups of containers that still run, remove the others (an earlier run's)."""
        for ctrl in self.ctrl_groups():
            mg = ctrl / "mon_groups"
            try:
                names = [e.name for e in os.scandir(mg) if e.is_dir() and e.name.startswith(GROUP_PREFIX)]
            except OSError:
                continue
            for n in names:
                cid = n[len(GROUP_PREFIX):]
                if cid in live and cid not in self.groups and (ctrl == self.control_dir or not self.cfg.control_group):
                    self.groups[cid] = MonGroup(live[cid], mg / n)
                    continue
                self._rmdir(MonGroup(ContainerIdentity(cid, "", "", "", ""), mg / n))
        self._cleaned = True

    # -- collection --------------------------------------------------------------------------------
    def domains(self, group_dir: Path) -> list[tuple[int, Path]]:
        out = []
        try:
            for e in os.scandir(group_dir / "mon_data"):
                if e.name.startswith("mon_L3_"):
                    try:
                        out.append((int(e.name[len("mon_L3_"):]), Path(e.path)))
                    except ValueError:
                        continue
        except OSError:
            return []
        return sorted(out)

    def _mon_value(self, b: bytes | None) -> MonValue:
        """A counter file's text (None: unreadable) as a value, counted in :attr:`readings`."""
        if b is None:
            self._recheck = True  # the group (or resctrl) may be gone: look at the directories next run
        v = parse_mon_value(b.decode() if b is not None else None)
        self.readings[v.status] = self.readings.get(v.status, 0) + 1
        return v

    def _read_counters(self, due: list[tuple[MonGroup, bool]]
                       ) -> list[tuple[list[tuple[str, int, str]], list[bytes | None]]]:
        """Each group's counter files (``MonGroup.reads``; only its occupancy files where ``due`` says True,
        :meth:`MonGroup.occupancy_reads`), as (the reads, their texts, None where unreadable). The files are
        kept open, and once all of a group's are, they are read for every group in one C-level loop: on
        resctrl each read is an IPI to a CPU of the domain (mon_event_read), on the test emulator a round trip
        to its FUSE server; nothing in between."""
        parts = [g.occupancy_reads() if occupancy_only else (g.reads or [], g.read_fds)
                 for g, occupancy_only in due]
        fds: list[int] = []
        for _, kept in parts:
            if kept is not None:
                fds += kept
        got: list[bytes | None] = []
        if fds:
            try:
                got = list(map(os.pread, fds, repeat(COUNTER_READ_SIZE, len(fds)), repeat(0, len(fds))))
            except OSError:  # a group removed behind our back (ENODEV): read one by one
                got = [_pread_or_none(fd, COUNTER_READ_SIZE) for fd in fds]
        out: list[tuple[list[tuple[str, int, str]], list[bytes | None]]] = []
        k = 0
        for (g, _), (reads, kept) in zip(due, parts, strict=True):
            if kept is not None:
                texts = got[k:k + len(reads)]
                k += len(reads)
                for j, b in enumerate(texts):
                    if b is not None and len(b) >= COUNTER_READ_SIZE:  # longer than a counter: read it all
                        texts[j] = _read_or_none(g.files, reads[j][2])
            else:
                texts = [_read_or_none(g.files, path) for _, _, path in reads]
                if reads is g.reads:
                    opened = [g.files.fds.get(path) for _, _, path in reads]
                    if all(fd is not None for fd in opened):
                        g.read_fds = opened  # type: ignore[assignment]
            out.append((reads, texts))
        return out

    def collect(self, now: float) -> list[Sample]:
        return self.collect_row(now).samples()

    def collect_row(self, now: float) -> Columns:
        """The run's series as one row of :class:`Columns`; the keys list is the same object as the last run's
        while the series are the same (between rotation slices), so the store resolves them only on change."""
        with self._lock:
            return self._collect(now)

    def _group_reads(self, domain_ids: list[int], files: list[str]) -> list[tuple[str, int, str]]:
        """A group's counter files as (file, cache id, path template), the list every group with these domains
        and files shares: 1,000 containers' groups each held theirs, ~0.45 MB of paths."""
        key = (tuple(domain_ids), tuple(files))
        got = self._reads_of.get(key)
        if got is None:
            got = self._reads_of[key] = [(f, c, f"{_REL}/mon_data/mon_L3_{c:02d}/{f}")
                                         for c in domain_ids for f in files]
        return got

    def _key(self, metric: str, labels: Mapping[str, str]) -> tuple[str, Mapping[str, str]]:
        """The one key tuple of a node-level series (few: per L3 domain, or none)."""
        k = (metric, tuple(labels.items()))
        got = self._keys.get(k)
        if got is None:
            got = self._keys[k] = (metric, labels)
        return got

    def _look(self) -> tuple[ResctrlInfo, CgroupLayout, list[int]]:
        """What changes only with a remount or a new CTRL_MON group: resctrl's info, the cgroup layout, the L3
        domains; and the node totals' files. Raises CollectorUnavailable as the collector is down."""
        self._static = None
        info = self._availability()
        self.info = info
        layout = detect_layout(self.cgroup_root)
        if layout is None:
            raise CollectorUnavailable(f"no cgroup hierarchy under {self.cgroup_root}")
        if not (self.control_dir / "mon_groups").is_dir():
            raise CollectorUnavailable(f"{self.control_dir / 'mon_groups'} does not exist (control_group "
                                       f"{self.cfg.control_group!r} is not a CTRL_MON group)")
        # Every group has one mon_L3_XX per L3 domain (the same set): list them once, from the root.
        domain_ids = [cid for cid, _ in self.domains(self.root)]
        mbm = [f for f in MBM_FILES if f in info.features]
        node_files = [*mbm, OCCUPANCY_FILE] if OCCUPANCY_FILE in info.features else mbm
        reads = [(str(ctrl), f, cache_id, f"{d}/{f}") for ctrl in self.ctrl_groups()
                 for cache_id, d in self.domains(ctrl) for f in node_files]
        if reads != self._node_reads:
            self._node_files.close()
            self._node_reads = reads
            self._node_group = None
        self._static = (info, layout, domain_ids)
        self._static_at = self.clock()
        return self._static

    def _collect(self, now: float) -> Columns:
        self._every = self.refresh_runs
        static = self._static
        look = static is None or self._recheck or self.clock() - self._static_at >= STATIC_REFRESH_SECONDS
        if look:
            prev_layout = static[1] if static is not None else None
            static = self._look()
            if prev_layout is not None and prev_layout != static[1]:
                self._probe = None
                for g in self.groups.values():
                    g.usage_path = g.threads_path = ""
        assert static is not None
        info, layout, domain_ids = static
        self._recheck = False
        self.issues = []
        self.readings = {}
        idents = {i.container_id: i for i in self.discovery.identities(layout)}
        if not self._cleaned:
            self._cleanup_stale(idents)

        for cid in [c for c in self.groups if c not in idents]:
            self._rmdir(self.groups.pop(cid))
            self._rmid_exhausted_at = None  # an RMID may be free again
        self.watches = {k: w for k, w in self.watches.items() if k in idents}
        self.unmonitored = {}
        self._tid_ctrl = None
        if look:  # groups removed behind our back (a read of theirs failed, or now and then): made again below
            present: dict[Path, set[str]] = {}
            for ctrl in {g.path.parent for g in self.groups.values()}:
                try:
                    present[ctrl] = set(os.listdir(ctrl))
                except OSError:
                    present[ctrl] = set()
            for cid in [c for c, g in self.groups.items() if g.path.name not in present[g.path.parent]]:
                del self.groups[cid]
                if cid in self.watches:
                    self.watches[cid].lost_group()
                    self._dirty = True

        for cid in [c for c, g in self.groups.items() if g.misplaced]:
            g = self.groups[cid]
            if self._ctrl_of(layout, g.ident) != g.ctrl:
                # The container changed class: its MON group moves to the new CTRL_MON group. Its counters
                # start again at 0 there; the watch keeps what was counted, so the exported total goes on.
                self._rmdir(self.groups.pop(cid))
                self._rmid_exhausted_at = None
                if cid in self.watches:
                    self.watches[cid].lost_group()
                    self._dirty = True
            else:
                g.misplaced = False

        usages = self._credit_idle(now)
        desired = self._plan(idents, info, now)
        for cid in [c for c in self.groups if c not in desired]:
            self._rmdir(self.groups.pop(cid))  # rotated out: its RMID goes to the next container
            self._rmid_exhausted_at = None
            self.watches.setdefault(cid, Watch(idents[cid])).lost_group(usages.get(cid), now)
            self._dirty = True
        for cid, why in desired.items():
            w = self.watches.get(cid) or self.watches.setdefault(cid, Watch(idents[cid]))
            if w.ident is not idents[cid] and w.ident != idents[cid]:
                w.rename(idents[cid])  # names arrived from the runtime
                self._dirty = True
            if w.reason != why:
                w.reason = why
                self._dirty = True
            if cid in self.groups:
                continue
            at = self._rmid_exhausted_at
            if at is not None and self.clock() - at < RMID_RETRY_SECONDS:
                # Out of RMIDs a moment ago: the next mkdir would fail the same way (and reset
                # last_cmd_status for nothing). Retry after RMID_RETRY_SECONDS or when a group is freed.
                self.unmonitored[cid] = (idents[cid], self._exhausted_reason)
                continue
            made = self._mkdir(idents[cid], self._ctrl_of(layout, idents[cid]))
            if made is not None:
                self.groups[cid] = made
                w.regrouped()  # a new RMID: its first read is a baseline
                self._dirty = True
        for cid, ident in idents.items():
            if cid not in self.groups and cid not in self.unmonitored:
                self.unmonitored[cid] = (ident, IDLE_REASON if self._rotation_class(cid) == 2
                                         else "waiting for its rotation slice")

        width = self.cfg.mbm_counter_width_bits
        mbm = [f for f in MBM_FILES if f in info.features]
        occ = OCCUPANCY_FILE in info.features
        files = [*mbm, OCCUPANCY_FILE] if occ else mbm
        every = self.refresh_runs
        idle_seconds = every * self.cfg.interval_seconds  # also a bound in time: runs may come late
        self.idle_groups = 0
        log_reads: list[str] | None = [] if self.read_log is not None else None
        row = self._row
        if row is not None and (self._dirty or row.groups != list(self.groups) or row.wids != list(self.watches)):
            row = None
        # The containers' CPU usage files, kept open, read for all groups in one C-level loop (see _probe).
        probe = self._probe
        got: list[bytes | None] | None = None
        if every > 1 and probe is not None and len(probe[0]) == len(self.groups) and all(
                map(is_, probe[0], self.groups.values())):
            fds, sizes = probe[1], probe[2]
            try:
                got = list(map(os.pread, fds, sizes, repeat(0, len(sizes))))
            except OSError:  # a cgroup removed before discovery saw it: read one by one
                got = list(map(_pread_or_none, fds, sizes))
            if None in got or any(map(eq, map(len, got), sizes)):  # type: ignore[arg-type]
                got = None  # unreadable, or as long as asked (it may have grown): each read on its own
        self._probe = None if got is None else probe
        # the groups whose counters this run reads (and whether only their occupancy: an idle refresh)
        due: list[tuple[str, MonGroup, Watch, bool]] = []
        for n, (cid, g) in enumerate(self.groups.items()):
            w = self.watches.get(cid) or self.watches.setdefault(cid, Watch(g.ident))
            if got is not None:
                usage_path, usage = g.usage_path, got[n]
            else:
                usage_path, usage = self._usage(layout, g) if every > 1 else ("", None)
            if log_reads is not None and usage_path:
                log_reads.append(usage_path)
            if (usage is not None and usage == g.usage and g.idle_runs + 1 < every and w.last_read is not None
                    and now - g.read_at < idle_seconds):
                # The container's tasks did not run since the counters were read: MBM counts only while its
                # RMID is loaded on a CPU, i.e. while its tasks run (resctrl.rst, "RMID"), so the counters
                # stand; occupancy can drop (others evict its lines) and is read again within ``every`` runs.
                g.idle_runs += 1
                self.idle_groups += 1
            else:
                first = g.usage is None
                # The idle refresh of a container that still did not run reads its occupancy files alone (the
                # MBM counters stand, above), and every MBM_IDLE_REFRESHES-th time its MBM counters too. Its
                # thread list is not read, nor the group's tasks re-checked: a thread that joined it and has not
                # run makes no traffic yet; when it runs, the usage moves and the next run syncs it.
                still = usage is not None and usage == g.usage and w.last_read is not None
                occupancy_only = still and g.still_refreshes + 1 < MBM_IDLE_REFRESHES  # (see the constant)
                g.still_refreshes = g.still_refreshes + 1 if occupancy_only else 0
                g.usage, g.read_at = usage, now
                g.idle_runs = n % every if first else 0  # groups made together refresh in turn
                if not still:
                    self._sync_tasks(layout, g)
                if g.reads is None:
                    g.files.rel = str(g.path)
                    g.reads = self._group_reads(domain_ids, files)
                if log_reads is not None:
                    log_reads += [g.files.path_of(p) for f, _, p in g.reads
                                  if not occupancy_only or f == OCCUPANCY_FILE]
                    if not still:
                        log_reads.append(self._threads_path(layout, g))
                due.append((cid, g, w, occupancy_only))
            # Watched time runs whether or not the counters were read: the group counted all along.
            if w.first_read is None:
                w.first_read = now
                row = None  # its monitored-seconds series starts
            elif w.last_read is not None and now > w.last_read:
                w.watched_seconds += now - w.last_read
            w.last_read = now
            w.last_watched = now
            if row is not None:
                i = row.widx.get(cid)
                if i is None:
                    row = None
                else:
                    row.seconds[i] = w.watched_seconds
        # Every counter file this run reads, the node totals' too, in one go (see _read_counters).
        node = self._node_group
        if node is None:  # (made again by _look when the files change)
            node = self._node_group = MonGroup(ContainerIdentity("", "", "", "", ""), self.root, files=self._node_files,
                                               reads=[(f, c, path) for _, f, c, path in self._node_reads])
        counters = self._read_counters([*((g, occupancy_only) for _, g, _, occupancy_only in due), (node, False)])
        node_texts = counters.pop()[1]
        for (cid, g, w, _), (reads, texts) in zip(due, counters, strict=True):
            occupancy = []
            n_observed = len(w.observed)
            for (fname, cache_id, _path), text in zip(reads, texts, strict=True):
                v = self._mon_value(text)
                if v.value is None:
                    continue
                if fname == OCCUPANCY_FILE:
                    occupancy.append((w.key(M.CONTAINER_LLC_OCCUPANCY.name, "cache_id", str(cache_id)),
                                      float(v.value)))
                    continue
                key = (fname, cache_id)
                prev = w.last_raw.get(key)
                if prev is not None:
                    w.observed[key] = w.observed.get(key, 0) + counter_delta(prev, v.value, width)
                else:
                    w.observed.setdefault(key, 0)
                w.last_raw[key] = v.value
            if row is not None:
                if (len(occupancy) != len(g.occupancy)
                        or not all(a[0] is b[0] for a, b in zip(occupancy, g.occupancy, strict=True))
                        or len(w.observed) != n_observed):
                    row = None  # a series came or went: laid out again below
                else:
                    row.read(cid, w, occupancy)
            g.occupancy = occupancy
        if log_reads is not None and self.read_log is not None:
            self.read_log.append(log_reads)
        if self._probe is None and every > 1:
            self._probe = self._make_probe()
        tail = self._node_totals(width, node_texts)
        if info.num_rmids is not None:
            tail.append(Sample(M.RDT_RMIDS.name, {}, float(info.num_rmids)))
        if self.capacity is not None:
            tail.append(Sample(M.RDT_RMID_BUDGET.name, {}, float(self.capacity)))
        tail.append(Sample(M.RDT_MON_GROUPS.name, {}, float(len(self.groups))))
        tail.append(Sample(M.RDT_WRITE_ERRORS.name, {}, float(self.write_errors_total)))
        tail_keys = [self._key(smp.metric, smp.labels) for smp in tail]
        if row is None:
            if self._row is not None:
                self._row.save()  # the estimates exported so far, into the watches
            row = self._layout_row(tail_keys, len(idents))
        elif row.tail_keys != tail_keys or row.unmonitored != self.unmonitored:
            ukeys, uvalues = self._unmonitored_series(tail_keys, len(idents))
            row = row.with_unmonitored(ukeys, uvalues, tail_keys, self.unmonitored)
            row.keys = self._kept_keys(row.keys)
        self._row = row
        self._dirty = False
        return row.fill(now, [smp.value for smp in tail])

    def _credit_idle(self, now: float) -> dict[str, float]:
        """Containers watched before and without a group now: the seconds they are known to have stood still
        (CPU usage unchanged between the cgroup collector's reads, :meth:`Watch.credit_idle`) count as
        watched, with zero bytes, so their rates are not scaled up for time in which they made no traffic,
        and rotation need not spend a group on them (:meth:`_rotation_class`). Off when every counter is read
        every run (``refresh_runs`` 1: CPU usage is not trusted as a sign of no traffic). Returns the CPU
        usage of every container as last read (seconds).

        The cgroup collector reads less often than this collector runs (5 s and 2 s by default): on a run where its
        snapshot is the one gone through last time, the never-watched containers' record stands as it is, and a
        watch whose base is that snapshot's usage is skipped (:meth:`Watch.credit_idle` would change nothing: the
        same usage at the same time, not after its ``idle_at``)."""
        if (self._every or self.refresh_runs) <= 1:
            return {}
        infos = getattr(self.discovery, "containers", {})
        same = infos is self._credit_infos
        if same:
            usages = self._credit_usages
        else:
            usages = {cid: u for cid, inf in infos.items() if (u := inf.stats.cpu_usage_seconds) is not None}
            unseen = self._unseen
            for cid, u in usages.items():
                w = self.watches.get(cid)
                if w is not None and w.first_read is not None:
                    continue
                got = unseen.get(cid)
                unseen[cid] = (u, False) if got is None else (u, got[1] or got[0] != u)
            if len(unseen) > len(usages):
                self._unseen = {cid: v for cid, v in unseen.items() if cid in usages}
            self._credit_infos, self._credit_usages = infos, usages
        row = self._row
        for cid, w in self.watches.items():
            if cid in self.groups or w.first_read is None:
                continue
            if same and w.idle_usage is not None and w.idle_usage == usages.get(cid):
                continue
            inf = infos.get(cid)
            if w.credit_idle(usages.get(cid), min(inf.last_seen, now) if inf is not None else now) and row is not None:
                i = row.widx.get(cid)
                if i is not None:
                    row.seconds[i] = w.watched_seconds
        return usages

    def _rotation_class(self, cid: str) -> int:
        """Who rotates in first: 0 a container that ran while unwatched (bytes unknown) or never watched and ran
        since first seen, 1 one holding a group now (keeping it costs nothing), 2 one that stood still since it
        was watched (its time is counted as watched with zero bytes, :meth:`_credit_idle`) or, never watched,
        since it was first seen (no bytes to count: its counter starts at its first watch, when it runs). All 0
        when idleness is not trusted."""
        if (self._every or self.refresh_runs) <= 1:
            return 0
        w = self.watches.get(cid)
        if w is None or w.first_read is None:
            if cid in self.groups:
                return 1
            got = self._unseen.get(cid)
            return 0 if got is None or got[1] else 2
        if w.ran_unwatched:
            return 0
        return 1 if cid in self.groups else 2

    def _make_probe(self) -> tuple[list[MonGroup], list[int], list[int]] | None:
        """(the groups, their CPU usage files' descriptors, the bytes to ask of each), when every group has
        that file open; None otherwise (read one by one until then)."""
        fds: list[int] = []
        sizes: list[int] = []
        for g in self.groups.values():
            fd = g.files.fds.get(g.usage_path) if g.usage_path else None
            if fd is None or g.usage is None:
                return None
            fds.append(fd)
            sizes.append(_ask(len(g.usage)))
        return list(self.groups.values()), fds, sizes

    def _layout_row(self, tail_keys: list[tuple[str, Mapping[str, str]]], n_idents: int) -> _Row:
        """Lay out the row for the groups, watches and unmonitored containers of this run."""
        keys: list[tuple[str, Mapping[str, str]]] = []
        values: list[float] = []
        occ_at: dict[str, int] = {}
        for cid, g in self.groups.items():
            occ_at[cid] = len(keys)
            for k, v in g.occupancy:
                keys.append(k)
                values.append(v)
        widx: dict[str, int] = {}
        est_slot: list[int] = []
        est_w: list[int] = []
        obs: list[float] = []
        exp: list[float] = []
        est_at: dict[str, tuple[int, int]] = {}
        ms_slot: list[int] = []
        ms_w: list[int] = []
        groups = self.groups
        watches = list(self.watches.values())
        for i, (cid, w) in enumerate(self.watches.items()):
            widx[cid] = i
            if w.first_read is None:
                continue
            est_at[cid] = (len(obs), len(w.observed))
            for key, skey in w.bandwidth_items():
                est_slot.append(len(keys))
                est_w.append(i)
                obs.append(float(w.observed[key]))
                exp.append(w.exported.get(key, 0.0))
                keys.append(skey)
                values.append(math.nan)
            ms_slot.append(len(keys))
            ms_w.append(i)
            keys.append(w.key(M.CONTAINER_RDT_MONITORED_SECONDS.name, "", ""))
            values.append(math.nan)
            if cid in groups:
                keys.append(w.key(M.CONTAINER_RDT_MONITORED.name, "reason", w.reason))
                values.append(1.0)
        for cid, w in self.watches.items():  # (a watch not read yet is monitored all the same)
            if w.first_read is None and cid in groups:
                keys.append(w.key(M.CONTAINER_RDT_MONITORED.name, "reason", w.reason))
                values.append(1.0)
        unmon_at = len(keys)
        ukeys, uvalues = self._unmonitored_series(tail_keys, n_idents)
        keys += ukeys
        values += uvalues
        return _Row(self._kept_keys(keys), np.array(values, dtype=np.float64), list(groups), list(self.watches),
                    watches, widx, occ_at, est_at, np.array(est_slot, dtype=np.int64), np.array(est_w, dtype=np.int64),
                    np.array(obs, dtype=np.float64), np.array(exp, dtype=np.float64),
                    np.array(ms_slot, dtype=np.int64), np.array(ms_w, dtype=np.int64),
                    np.array([w.first_read if w.first_read is not None else math.nan for w in watches],
                             dtype=np.float64),
                    np.array([w.watched_seconds for w in watches], dtype=np.float64),
                    np.array([w.gaps for w in watches], dtype=bool),
                    unmon_at, unmon_at + len(self.unmonitored), tail_keys, dict(self.unmonitored))

    def _kept_keys(self, keys: list[tuple[str, Mapping[str, str]]]) -> list[tuple[str, Mapping[str, str]]]:
        """The last row's keys list when ``keys`` holds the same key tuples (compared by identity first: the
        store's column plan for it stands), else ``keys``, kept as the last."""
        if keys == self._row_keys:
            return self._row_keys
        self._row_keys = keys
        return keys

    def _unmonitored_series(self, tail_keys: list[tuple[str, Mapping[str, str]]],
                            n_idents: int) -> tuple[list[tuple[str, Mapping[str, str]]], list[float]]:
        """The end of the row: the unmonitored containers' rdt_monitored 0 series (their keys made once per
        container and reason code), then the node-level series ``tail_keys``; their keys and placeholder values."""
        keys: list[tuple[str, Mapping[str, str]]] = []
        unmon = self._unmonitored_keys
        if len(unmon) > 4 * max(64, n_idents):
            unmon.clear()  # containers gone: start again
        codes = self._codes
        if len(codes) > 64:
            codes.clear()
        for cid, (ident, reason) in self.unmonitored.items():
            code = codes.get(reason)
            if code is None:
                code = codes[reason] = ("rmid_limbo" if "limbo" in reason else "rmid_exhausted" if "RMID" in reason
                                        else "rotation_wait" if "rotation" in reason
                                        else "idle" if reason == IDLE_REASON else "mkdir_failed")
            got = unmon.get((cid, code))
            if got is None or got[1] is not ident:
                got = unmon[(cid, code)] = ((M.CONTAINER_RDT_MONITORED.name,
                                             LabelSet({**ident.labels(), "reason": code})), ident)
            keys.append(got[0])
        values = [0.0] * len(keys) + [math.nan] * len(tail_keys)
        keys += tail_keys
        return keys, values

    # -- the RMID budget -----------------------------------------------------------------------------
    def rmids_used_by_others(self) -> int:
        """RMIDs held by groups that are not the agent's: the root group's, every other CTRL_MON group's
        and every MON group that is not ours (each holds one: resctrl.rst, "RMID"). Counted again at most every
        STATIC_REFRESH_SECONDS (a listing of every CTRL_MON group's mon_groups; asked at every slice boundary):
        a group made by someone else meanwhile shows as a failed mkdir, which lowers the budget at once."""
        got = self._others
        now = self.clock()
        if got is not None and now - got[0] < STATIC_REFRESH_SECONDS:
            return got[1]
        n = 0
        for ctrl in self.ctrl_groups():
            n += 1
            try:
                for e in os.scandir(ctrl / "mon_groups"):
                    if not e.name.startswith(GROUP_PREFIX):
                        n += 1
            except OSError:
                continue
        self._others = (now, n)
        return n

    def _estimate_capacity(self, info: ResctrlInfo) -> int | None:
        """MON groups the agent may hold: what ``num_rmids`` leaves after the others' groups, lowered to
        what held when a mkdir last failed (RMIDs in limbo are not visible as groups); that lesson is
        forgotten after RMID_RETRY_SECONDS so that freed RMIDs are used again."""
        if self._learned_capacity is not None and self.clock() - self._learned_at >= RMID_RETRY_SECONDS:
            self._learned_capacity = None
        est = None if info.num_rmids is None else max(0, info.num_rmids - self.rmids_used_by_others())
        if self._learned_capacity is not None:
            est = self._learned_capacity if est is None else min(est, self._learned_capacity)
        return est

    def _tier_of(self, ident: ContainerIdentity) -> tuple[bool, int]:
        """Whether a ``priority`` selector matches the container (:meth:`_is_priority`), and its QoS class's place in
        ``qos_order``: worked out once per identity object."""
        cfg = self.cfg
        tier = self._tier.get(ident.container_id)
        if tier is None or tier[0] is not ident:
            qos = cfg.qos_order.index(ident.qos_class) if ident.qos_class in cfg.qos_order else len(cfg.qos_order)
            tier = self._tier[ident.container_id] = (ident, self._is_priority(ident), qos)
            if len(self._tier) > 4 * max(1024, len(self.watches)):
                self._tier = {ident.container_id: tier}  # containers gone: start again
        return tier[1], tier[2]

    def _rank_key(self, ident: ContainerIdentity) -> tuple:
        """Most important first: a configured selector, then QoS class, then CPU use."""
        prio, qos = self._tier_of(ident)
        cpu = self._cpu_rate.get(ident.container_id, 0.0) if self.cfg.rank_by_cpu else 0.0
        return (not prio, qos, -cpu, ident.container_id)

    def _is_priority(self, ident: ContainerIdentity) -> bool:
        """A ``priority`` selector matches, or the pod says so (``<priority_annotation>/pod: "true"`` or
        ``.../container.<name>: "true"``)."""
        if any(_matches(sel, ident) for sel in self.cfg.priority):
            return True
        v = ident.annotated(self.cfg.priority_annotation) if self.cfg.priority_annotation else None
        return v is not None and v.strip().lower() in ("true", "1", "yes")

    def _update_cpu(self) -> None:
        """CPU use per container from what the cgroup collector read last (no extra reads here)."""
        infos = getattr(self.discovery, "containers", {})
        rates = {}
        for cid, inf in infos.items():
            u = inf.stats.cpu_usage_seconds
            if u is None:
                continue
            prev = self._cpu.get(cid)
            if prev is None or inf.last_seen > prev[0]:
                if prev is not None:
                    rates[cid] = max(0.0, (u - prev[1]) / (inf.last_seen - prev[0]))
                self._cpu[cid] = (inf.last_seen, u)
        self._cpu = {k: v for k, v in self._cpu.items() if k in infos}
        self._cpu_rate = {k: v for k, v in {**self._cpu_rate, **rates}.items() if k in infos}

    def _plan(self, idents: dict[str, ContainerIdentity], info: ResctrlInfo, now: float) -> dict[str, str]:
        """Which containers hold a MON group in this cycle, and why (the ``reason`` of rdt_monitored).

        Everyone while the RMIDs suffice ("all"). Otherwise the ranked first keep theirs ("priority" for a
        selector match, else "ranked"), and ``rotation_share`` of the budget rotates through the rest, the
        least recently watched first, one ``rotation_slice_seconds`` slice at a time ("rotation").
        """
        slice_idx = int(now // self.cfg.rotation_slice_seconds)
        boundary = slice_idx != self._slice
        if boundary or (self._learned_capacity is not None
                        and (self.capacity is None or self._learned_capacity < self.capacity)):
            # A new slice, or a mkdir failed for want of RMIDs mid-slice: re-plan within what holds.
            boundary = True
            self._slice = slice_idx
            self.capacity = self._estimate_capacity(info)
        cap = self.capacity
        if cap is None or len(idents) <= cap:
            self._desired = {cid: "all" for cid in idents}
            return dict(self._desired)
        rotating_slots = min(cap, max(1, int(cap * self.cfg.rotation_share))) if cap > 0 else 0
        fixed_n = cap - rotating_slots
        if boundary:
            self._update_cpu()  # only where a ranking is made: CPU use over the time since the last one
            ranked = sorted(idents.values(), key=self._rank_key)
            top = self._keep_holders(ranked, fixed_n)
            desired: dict[str, str] = {}
            for ident in top:
                desired[ident.container_id] = "priority" if self._tier_of(ident)[0] else "ranked"
            rest = sorted((i for i in ranked if i.container_id not in desired),
                          key=lambda i: (self._rotation_class(i.container_id), self._last_watched(i.container_id),
                                         i.container_id))
            for ident in rest[:rotating_slots]:
                desired[ident.container_id] = "rotation"
        else:
            desired = {cid: why for cid, why in self._desired.items() if cid in idents}
            # slots freed by exited containers go to the next in line (ranked only when there is one: no
            # sort of every container in a run where no slot is free)
            if len(desired) < cap:
                self._update_cpu()
            for ident in sorted(idents.values(), key=self._rank_key) if len(desired) < cap else ():
                if len(desired) >= cap:
                    break
                desired.setdefault(ident.container_id, "rotation")
        self._desired = desired
        return dict(desired)

    def _keep_holders(self, ranked: list[ContainerIdentity], fixed_n: int) -> list[ContainerIdentity]:
        """The ranked first ``fixed_n`` of ``ranked`` (best first), except that a container holding a ranked group
        keeps it against the weakest newcomer among them unless that one clearly outranks it (:meth:`_outranks`):
        hysteresis against groups changing hands between containers of about the same CPU use."""
        top = ranked[:fixed_n]
        held = {cid for cid, why in self._desired.items() if why in ("ranked", "priority") and cid in self.groups}
        for holder in [i for i in ranked[fixed_n:] if i.container_id in held]:  # best first
            j = next((j for j in range(len(top) - 1, -1, -1) if top[j].container_id not in held), None)
            if j is None or self._outranks(top[j], holder):
                break  # the weakest newcomer outranks this holder clearly: so do the others, and the next holders
            top[j] = holder
        return top

    def _outranks(self, challenger: ContainerIdentity, holder: ContainerIdentity) -> bool:
        """Whether ``challenger`` takes ``holder``'s group: a better priority or QoS tier does; within a tier, CPU
        use RANK_KEEP_RATIO times the holder's and RANK_KEEP_MARGIN_CPU more."""
        kc, kh = self._rank_key(challenger), self._rank_key(holder)
        if kc[:2] != kh[:2]:
            return kc[:2] < kh[:2]
        cpu_c, cpu_h = -kc[2], -kh[2]
        return cpu_c >= cpu_h * RANK_KEEP_RATIO and cpu_c - cpu_h >= RANK_KEEP_MARGIN_CPU

    def _last_watched(self, cid: str) -> float:
        w = self.watches.get(cid)
        return w.last_watched if w is not None else float("-inf")

    def _node_totals(self, width: int, texts: list[bytes | None]) -> list[Sample]:
        """Sums over the CTRL_MON groups (listed by _look, their files kept open): ``texts`` are their counter
        files as read this run, in ``_node_reads`` order."""
        bw: dict[tuple[str, int], int] = {}
        occupancy: dict[int, int] = {}
        node = self._node
        for (ctrl, fname, cache_id, _path), text in zip(self._node_reads, texts, strict=True):
            v = self._mon_value(text)
            if fname == OCCUPANCY_FILE:
                if v.value is not None:
                    occupancy[cache_id] = occupancy.get(cache_id, 0) + v.value
                continue
            c = node.get((ctrl, fname, cache_id))
            if c is None:
                c = node[(ctrl, fname, cache_id)] = Counter()
            if v.value is not None:
                c.advance(v.value, width)
        # Counters of CTRL_MON groups removed since keep their totals, so the node counter never drops.
        for (_ctrl, fname, cache_id), c in self._node.items():
            if c.last_raw is not None:
                bw[(fname, cache_id)] = bw.get((fname, cache_id), 0) + c.total
        out = [Sample(M.NODE_MEMORY_BANDWIDTH.name, {"scope": MBM_FILES[f], "cache_id": str(cid)}, float(v))
               for (f, cid), v in sorted(bw.items())]
        out += [Sample(M.NODE_LLC_OCCUPANCY.name, {"cache_id": str(cid)}, float(v))
                for cid, v in sorted(occupancy.items())]
        return out

    def close(self) -> None:
        """Remove the agent's MON groups: their tasks go back to the parent group (resctrl.rst)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._row is not None:
            self._row.save()  # the watches outlive their groups: their estimates go on from what was written
        for g in self.groups.values():
            self._rmdir(g)
        self.groups.clear()
        self._node_files.close()
        self._node_group = None
        self._static = None
        self._row = None
        self._probe = None



def _matches(sel, ident: ContainerIdentity) -> bool:
    return all(fnmatch.fnmatchcase(v, pat) for v, pat in (
        (ident.namespace, sel.namespace), (ident.pod, sel.pod), (ident.name, sel.container),
        (ident.container_id, sel.container_id)))
