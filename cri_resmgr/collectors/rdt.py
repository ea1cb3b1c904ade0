"""Per-container memory bandwidth (RDT MBM) and LLC occupancy (RDT CMT) through resctrl.

Follows Documentation/arch/x86/resctrl.rst (Documentation/filesystems/resctrl.rst since 6.16):

- one MON group per container, ``<control group>/mon_groups/cri-resmgr.<container id>``, in the root
  CTRL_MON group unless ``control_group`` names another; a MON group's ``tasks`` only takes tasks of its
  parent CTRL_MON group ("the task must already belong to the CTRL_MON parent of this group").
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
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import metrics as M
from ..config import RdtCollectorConfig
from ..store import Sample
from ..sysfs import read_int, read_text
from .base import Collector, CollectorUnavailable, Probe
from .cgroup import CgroupCollector, CgroupLayout, detect_layout
from .identity import ContainerIdentity

log = logging.getLogger(__name__)

GROUP_PREFIX = "cri-resmgr."
MBM_FILES = {"mbm_total_bytes": "total", "mbm_local_bytes": "local"}
OCCUPANCY_FILE = "llc_occupancy"
NOT_COUNTS = ("Unavailable", "Error", "Unassigned")
RESERVED_DIRS = {"info", "mon_groups", "mon_data"}
RMID_RETRY_SECONDS = 30.0
# Reading a group's ``tasks`` walks every thread on the machine (rdtgroup_tasks_show loops over all
# threads), so the collector trusts its own record of what it wrote and re-reads the file only this often
# (to see tasks that someone else moved away).
TASKS_VERIFY_SECONDS = 60.0


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
    counters: dict[tuple[str, int], Counter] = field(default_factory=dict)  # (file, cache id)
    synced: set[int] = field(default_factory=set)  # thread ids known to be in the group
    verified_at: float | None = None


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
        self._lock = threading.Lock()

    def reconfigure(self, cfg: RdtCollectorConfig) -> None:
        """Apply a reloaded configuration (called from the reload thread, hence the lock)."""
        with self._lock:
            if cfg.control_group != self.cfg.control_group or not cfg.enabled:
                self._close()
                self._cleaned = False
            self.cfg = cfg

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
            names = [f"{_short(i)} ({r})" for i, r in list(self.unmonitored.values())[:5]]
            more = f" and {len(self.unmonitored) - 5} more" if len(self.unmonitored) > 5 else ""
            parts.append(f"unmonitored {len(self.unmonitored)}: {', '.join(names)}{more}")
        bad = {k: v for k, v in self.readings.items() if k != "ok"}
        if bad:
            parts.append("readings not counted: " + ", ".join(f"{v} {k}" for k, v in sorted(bad.items())))
        if self.issues:
            parts.append(f"errors: {self.issues[0]}" + (f" (+{len(self.issues) - 1} more)" if len(self.issues) > 1 else ""))
        return "; ".join(parts)

    # -- resctrl operations, each failure reporting last_cmd_status -----------------------------------
    def last_cmd_status(self) -> str:
        return (read_text(self.root / "info" / "last_cmd_status") or "").strip() or "(empty)"

    def _issue(self, ident: ContainerIdentity | None, op: str, path: Path, e: OSError) -> RdtIssue:
        issue = RdtIssue(ident.container_id if ident else "", op, str(path), e.strerror or str(e), self.last_cmd_status())
        self.issues.append(issue)
        self.write_errors_total += 1
        log.warning("resctrl: %s", issue)
        return issue

    def _mkdir(self, ident: ContainerIdentity) -> MonGroup | None:
        path = self.control_dir / "mon_groups" / (GROUP_PREFIX + ident.container_id)
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError as e:
            issue = self._issue(ident, "mkdir", path, e)
            if e.errno in (errno.ENOSPC, errno.EBUSY):
                self._rmid_exhausted_at = self.clock()
                kind = "no free RMID" if e.errno == errno.ENOSPC else "RMIDs busy in limbo"
                self._exhausted_reason = f"{kind}: {issue.last_cmd_status}"
                self.unmonitored[ident.container_id] = (ident, self._exhausted_reason)
            else:
                self.unmonitored[ident.container_id] = (ident, f"mkdir failed: {issue.error}; {issue.last_cmd_status}")
            return None
        return MonGroup(ident, path)

    def _rmdir(self, g: MonGroup) -> None:
        try:
            os.rmdir(g.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._issue(g.ident, "rmdir", g.path, e)

    def _sync_tasks(self, layout: CgroupLayout, g: MonGroup) -> None:
        want = container_threads(layout, g.ident.cgroup_path)
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
                if ctrl == self.control_dir and cid in live:
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

    def _read(self, d: Path, fname: str) -> MonValue:
        v = parse_mon_value(read_small(d / fname))
        self.readings[v.status] = self.readings.get(v.status, 0) + 1
        return v

    def collect(self, now: float) -> list[Sample]:
        with self._lock:
            return self._collect(now)

    def _collect(self, now: float) -> list[Sample]:
        info = self._availability()
        self.info = info
        layout = detect_layout(self.cgroup_root)
        if layout is None:
            raise CollectorUnavailable(f"no cgroup hierarchy under {self.cgroup_root}")
        if not (self.control_dir / "mon_groups").is_dir():
            raise CollectorUnavailable(f"{self.control_dir / 'mon_groups'} does not exist (control_group "
                                       f"{self.cfg.control_group!r} is not a CTRL_MON group)")
        self.issues = []
        self.readings = {}
        idents = {i.container_id: i for i in self.discovery.identities(layout)}
        if not self._cleaned:
            self._cleanup_stale(idents)

        for cid in [c for c in self.groups if c not in idents]:
            self._rmdir(self.groups.pop(cid))
            self._rmid_exhausted_at = None  # an RMID may be free again
        self.unmonitored = {k: v for k, v in self.unmonitored.items() if k in idents}
        try:
            present = {e.name for e in os.scandir(self.control_dir / "mon_groups")}
        except OSError:
            present = set()
        for cid in [c for c, g in self.groups.items() if g.path.name not in present]:
            del self.groups[cid]  # removed behind our back: made again below
        for cid, ident in idents.items():
            if cid in self.groups:
                continue
            at = self._rmid_exhausted_at
            if at is not None and self.clock() - at < RMID_RETRY_SECONDS:
                # Out of RMIDs a moment ago: the next mkdir would fail the same way (and reset
                # last_cmd_status for nothing). Retry after RMID_RETRY_SECONDS or when a group is freed.
                self.unmonitored[cid] = (ident, self._exhausted_reason)
                continue
            g = self._mkdir(ident)
            if g is not None:
                self.unmonitored.pop(cid, None)
                self.groups[cid] = g

        samples: list[Sample] = []
        width = self.cfg.mbm_counter_width_bits
        mbm = [f for f in MBM_FILES if f in info.features]
        occ = OCCUPANCY_FILE in info.features
        # Every group has one mon_L3_XX per L3 domain (the same set): list them once, from the root.
        domain_ids = [cid for cid, _ in self.domains(self.root)]
        for cid, g in self.groups.items():
            self._sync_tasks(layout, g)
            lab = g.ident.labels()
            for cache_id in domain_ids:
                d = g.path / "mon_data" / f"mon_L3_{cache_id:02d}"
                for fname in mbm:
                    v = self._read(d, fname)
                    if v.value is not None:
                        total = g.counters.setdefault((fname, cache_id), Counter()).advance(v.value, width)
                        samples.append(Sample(M.CONTAINER_MEMORY_BANDWIDTH.name,
                                              {**lab, "scope": MBM_FILES[fname], "cache_id": str(cache_id)}, float(total)))
                if occ:
                    v = self._read(d, OCCUPANCY_FILE)
                    if v.value is not None:
                        samples.append(Sample(M.CONTAINER_LLC_OCCUPANCY.name, {**lab, "cache_id": str(cache_id)},
                                              float(v.value)))
            samples.append(Sample(M.CONTAINER_RDT_MONITORED.name, {**lab, "reason": ""}, 1.0))
        for ident, reason in self.unmonitored.values():
            code = "rmid_exhausted" if "RMID" in reason else "mkdir_failed"
            samples.append(Sample(M.CONTAINER_RDT_MONITORED.name, {**ident.labels(), "reason": code}, 0.0))
        samples += self._node_totals(mbm, occ, width)
        if info.num_rmids is not None:
            samples.append(Sample(M.RDT_RMIDS.name, {}, float(info.num_rmids)))
        samples.append(Sample(M.RDT_MON_GROUPS.name, {}, float(len(self.groups))))
        samples.append(Sample(M.RDT_WRITE_ERRORS.name, {}, float(self.write_errors_total)))
        return samples

    def _node_totals(self, mbm: list[str], occ: bool, width: int) -> list[Sample]:
        bw: dict[tuple[str, int], int] = {}
        occupancy: dict[int, int] = {}
        for ctrl in self.ctrl_groups():
            for cache_id, d in self.domains(ctrl):
                for fname in mbm:
                    v = self._read(d, fname)
                    c = self._node.setdefault((str(ctrl), fname, cache_id), Counter())
                    if v.value is not None:
                        c.advance(v.value, width)
                if occ:
                    v = self._read(d, OCCUPANCY_FILE)
                    if v.value is not None:
                        occupancy[cache_id] = occupancy.get(cache_id, 0) + v.value
        # Counters of CTRL_MON groups removed since keep their totals, so the node counter never drops.
        for (_ctrl, fname, cache_id), c in self._node.items():
            if c.last_raw is not None:
                bw[(fname, cache_id)] = bw.get((fname, cache_id), 0) + c.total
        out = [Sample(M.NODE_MEMORY_BANDWIDTH.name, {"scope": MBM_FILES[f], "cache_id": str(cid)}, float(v))
               for (f, cid), v in sorted(bw.items())]
        out += [Sample(M.NODE_LLC_OCCUPANCY.name, {"cache_id": str(cid)}, float(v)) for cid, v in sorted(occupancy.items())]
        return out

    def close(self) -> None:
        """Remove the agent's MON groups: their tasks go back to the parent group (resctrl.rst)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        for g in self.groups.values():
            self._rmdir(g)
        self.groups.clear()


def _short(ident: ContainerIdentity) -> str:
    if ident.namespace or ident.pod or ident.name:
        return f"{ident.namespace}/{ident.pod}/{ident.name or ident.container_id[:12]}"
    return ident.container_id[:12]
