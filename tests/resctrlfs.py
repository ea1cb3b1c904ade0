"""A resctrl emulator mounted with FUSE, for machines without RDT (this one, CI).

A plain directory cannot act like resctrl: ``mkdir mon_groups/x`` must create the ``mon_data`` tree
or fail with ENOSPC when RMIDs run out, ``rmdir`` must remove a non-empty group, a write to ``tasks``
must be validated and fail with EINVAL or ESRCH, and ``info/last_cmd_status`` must say why. So this is a
small filesystem (mfusepy over libfuse3) that follows Documentation/arch/x86/resctrl.rst:

- ``info/last_cmd_status`` ("ok" after every successful command, the reason after a failed one),
  ``info/L3_MON/{num_rmids,mon_features,max_threshold_occupancy}`` when monitoring is on,
  ``info/L3/{num_closids,cbm_mask,min_cbm_bits}`` and ``info/MB/{min_bandwidth,bandwidth_gran}`` for the
  allocation resources;
- ``schemata`` writes follow the kernel's allocation rules (:class:`AllocationRules`: CBMs within cbm_mask,
  contiguous, at least min_cbm_bits; MB ranges and granularity or MBps with ``mba_MBps``; CDP as
  L3CODE/L3DATA; a refused write changes nothing and says why in last_cmd_status); a CTRL_MON ``mkdir``
  past num_closids fails ENOSPC, "Out of CLOSIDs";
- the root CTRL_MON group and ``mkdir``-made ones at the top level, each with ``tasks``, ``cpus``,
  ``cpus_list``, ``schemata`` (with allocation), ``mon_groups/`` and ``mon_data/mon_L3_XX/<event>``;
- MON groups under ``<ctrl>/mon_groups/``; each CTRL_MON or MON group holds one RMID out of
  ``num_rmids`` (the root's is RMID 0). ``mkdir`` past the limit fails ENOSPC, "Out of RMIDs", or EBUSY
  while freed RMIDs are in limbo (``limbo_seconds`` of emulated time after their group's rmdir).
- ``tasks`` writes take one task id; a MON group only takes tasks of its parent CTRL_MON group
  ("Can't move task to different control group", EINVAL), unknown ids fail ESRCH ("No task N").
- a MON group's event files count its own tasks; a CTRL_MON group's the sum of its own and its MON
  groups'.

The "hardware" is a per-task truth: :meth:`set_task` gives a task bandwidth rates (bytes/s per L3
domain, total and local) and an occupancy; :meth:`advance` moves time, adding rate x seconds to the
counter of the RMID that owns each task at that moment, wrapping at ``2**width_bits`` like a hardware
counter would. :meth:`set_status` makes an event file read ``Unavailable`` or ``Error``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

FEATURES_ALL = ("llc_occupancy", "mbm_total_bytes", "mbm_local_bytes")
MNT_DETACH = 2


def fuse_unavailable() -> str | None:
    """Why the emulator cannot run here, or None."""
    if os.geteuid() != 0:
        return "mounting the FUSE resctrl emulator needs root"
    if not Path("/dev/fuse").exists():
        return "/dev/fuse is absent"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:  # OSError: libfuse3 not installed
        return f"mfusepy/libfuse3 unavailable: {e}"
    return None


@dataclass
class Group:
    name: str
    ctrl: Group | None  # parent CTRL_MON group for a MON group, None for a CTRL_MON group
    rmid: int
    counters: dict[tuple[int, str], int] = field(default_factory=dict)  # (domain, event) -> raw value
    mon_groups: dict[str, Group] = field(default_factory=dict)

    @property
    def is_ctrl(self) -> bool:
        return self.ctrl is None


@dataclass
class TaskTruth:
    mbm_total: dict[int, float] = field(default_factory=dict)  # domain -> bytes/s
    mbm_local: dict[int, float] = field(default_factory=dict)
    occupancy: dict[int, int] = field(default_factory=dict)  # domain -> bytes


class AllocError(Exception):
    """A schemata write the kernel refuses: errno and the info/last_cmd_status text."""

    def __init__(self, err: int, status: str):
        super().__init__(status)
        self.errno = err
        self.status = status


@dataclass
class AllocationRules:
    """The kernel's allocation rules (Documentation/arch/x86/resctrl.rst; messages as fs/resctrl/ctrlmondata.c
    writes them to info/last_cmd_status): CBMs within cbm_mask, contiguous, at least min_cbm_bits; MB a
    percentage in [min_bandwidth, 100] rounded up to bandwidth_gran, or any MBps value with ``mba_mbps``
    (whose default is U32_MAX); CDP splits L3 into L3CODE/L3DATA with half the CLOSIDs; a CTRL_MON group takes
    a CLOSID out of the smallest num_closids (the root group has CLOSID 0)."""

    cbm_mask: int = 0xFFF
    min_cbm_bits: int = 1
    shareable_bits: int = 0
    l3_closids: int = 16
    mb_closids: int = 8
    min_bandwidth: int = 10
    bandwidth_gran: int = 10
    cdp: bool = False
    mba_mbps: bool = False

    def resources(self, allocation) -> list[str]:
        out = (["L3CODE", "L3DATA"] if self.cdp else ["L3"]) if "L3" in allocation else []
        return out + (["MB"] if "MB" in allocation else [])

    def num_closids(self, allocation) -> int:
        n = [self.l3_closids // (2 if self.cdp else 1)] if "L3" in allocation else []
        return min(n + ([self.mb_closids] if "MB" in allocation else []), default=0)

    def info(self, allocation) -> dict[str, dict[str, str]]:
        tree: dict[str, dict[str, str]] = {}
        for res in self.resources(allocation):
            if res == "MB":
                tree[res] = {"num_closids": f"{self.mb_closids}\n", "min_bandwidth": f"{self.min_bandwidth}\n",
                             "bandwidth_gran": f"{self.bandwidth_gran}\n", "delay_linear": "1\n"}
            else:
                tree[res] = {"num_closids": f"{self.l3_closids // (2 if self.cdp else 1)}\n",
                             "cbm_mask": f"{self.cbm_mask:x}\n", "min_cbm_bits": f"{self.min_cbm_bits}\n",
                             "shareable_bits": f"{self.shareable_bits:x}\n"}
        return tree

    def defaults(self, allocation, domains) -> dict[str, dict[int, int]]:
        mb = 2**32 - 1 if self.mba_mbps else 100
        return {r: {d: (mb if r == "MB" else self.cbm_mask) for d in domains} for r in self.resources(allocation)}

    def render(self, schemata: dict[str, dict[int, int]]) -> str:
        return "".join(f"{r}:" + ";".join((f"{d}={v}" if r == "MB" else f"{d}={v:x}") for d, v in sorted(vals.items()))
                       + "\n" for r, vals in schemata.items())

    def _value(self, res: str, text: str) -> int:
        if res == "MB":
            if not text.isdigit():
                raise AllocError(errno.EINVAL, f"Non-decimal digit in MB value {text}")
            bw = int(text)
            if self.mba_mbps:
                return bw
            if not self.min_bandwidth <= bw <= 100:
                raise AllocError(errno.EINVAL, f"MB value {bw} out of range [{self.min_bandwidth},100]")
            return -(-bw // self.bandwidth_gran) * self.bandwidth_gran
        try:
            val = int(text, 16)
        except ValueError:
            raise AllocError(errno.EINVAL, f"Non-hex character in the mask {text}") from None
        if (self.min_cbm_bits > 0 and val == 0) or val > self.cbm_mask:
            raise AllocError(errno.EINVAL, "Mask out of range")
        low = (val & -val).bit_length() - 1
        run = (val >> low) if val else 0
        if run & (run + 1):
            raise AllocError(errno.EINVAL, f"The mask {val:x} has non-consecutive 1-bits")
        if run.bit_length() < self.min_cbm_bits:
            raise AllocError(errno.EINVAL, f"Need at least {self.min_cbm_bits} bits in the mask")
        return val

    def apply(self, current: dict[str, dict[int, int]], text: str) -> dict[str, dict[int, int]]:
        """The group's schemata after writing ``text``: all lines are checked before any is applied
        (rdtgroup_schemata_write stages the whole write)."""
        staged = {r: dict(v) for r, v in current.items()}
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            res, sep, rest = line.partition(":")
            if not sep:
                raise AllocError(errno.EINVAL, "Missing ':'")
            res = res.strip()
            if res not in staged:
                raise AllocError(errno.EINVAL, f"Unknown or unsupported resource name '{res}'")
            seen: set[int] = set()
            for item in rest.split(";"):
                dom, eq, val = item.strip().partition("=")
                if not eq or not dom.strip().isdigit():
                    raise AllocError(errno.EINVAL, "Missing '=' or non-numeric domain")
                d = int(dom)
                if d not in staged[res]:
                    raise AllocError(errno.EINVAL, f"Unknown domain {d}")
                if d in seen:
                    raise AllocError(errno.EINVAL, f"Duplicate domain {d}")
                seen.add(d)
                staged[res][d] = self._value(res, val.strip())
        return staged


def _enoent():
    import mfusepy

    return mfusepy.FuseOSError(errno.ENOENT)


class ResctrlEmulator:
    def __init__(self, domains=(0, 1), features=FEATURES_ALL, num_rmids: int = 16, allocation=("L3", "MB"),
                 monitoring: bool = True, width_bits: int = 64, known_tasks: set[int] | None = None,
                 rules: AllocationRules | None = None):
        self.domains = tuple(domains)
        self.features = tuple(features) if monitoring else ()
        self.num_rmids = num_rmids
        self.allocation = tuple(allocation)
        self.monitoring = monitoring
        self.width_bits = width_bits
        self.known_tasks = known_tasks  # None: any positive id is a task
        self.rules = rules or AllocationRules()
        self.schemata: dict[str, dict[str, dict[int, int]]] = {"": self.rules.defaults(self.allocation, self.domains)}
        self.root = Group("", None, 0)
        self.ctrls: dict[str, Group] = {}
        self.task_ctrl: dict[int, Group] = {}  # tasks not listed are in the root group
        self.task_mon: dict[int, Group] = {}
        self.truth: dict[int, TaskTruth] = {}
        self.status: dict[tuple[str, int, str], str] = {}  # (group path, domain, event) -> Unavailable/Error
        self.last_cmd_status = "ok"
        self.freed_rmids: list[int] = []
        self.next_rmid = 1
        # RMID limbo (arch/x86/kernel/cpu/resctrl/monitor.c): a freed RMID is reused only once the cache lines
        # it tagged have been evicted; until then a mkdir that finds no free RMID fails EBUSY, not ENOSPC.
        # 0: freed RMIDs are free at once. Time is the emulated time of advance().
        self.limbo_seconds = 0.0
        self.limbo: list[tuple[int, float]] = []  # (rmid, emulated time it leaves limbo)
        self.emulated_seconds = 0.0
        self.commands: list[str] = []  # every mkdir/rmdir/write, for tests to inspect
        self.lock = threading.RLock()
        self.mountpoint: Path | None = None
        self._thread: threading.Thread | None = None

    # -- emulated hardware -------------------------------------------------------------------------
    def set_task(self, tid: int, mbm_total: dict[int, float] | None = None, mbm_local: dict[int, float] | None = None,
                 occupancy: dict[int, int] | None = None) -> None:
        with self.lock:
            self.truth[tid] = TaskTruth(dict(mbm_total or {}), dict(mbm_local or {}), dict(occupancy or {}))

    def move_task_to_ctrl(self, tid: int, ctrl_name: str) -> None:
        """What another tool (or a CAT class assignment) does: put a task in another CTRL_MON group."""
        with self.lock:
            self.task_ctrl[tid] = self.ctrls[ctrl_name] if ctrl_name else self.root
            self.task_mon.pop(tid, None)

    def owner(self, tid: int) -> Group:
        return self.task_mon.get(tid) or self.task_ctrl.get(tid) or self.root

    def advance(self, seconds: float) -> None:
        with self.lock:
            self.emulated_seconds += seconds
            mod = 1 << self.width_bits
            for tid, t in self.truth.items():
                g = self.owner(tid)
                for event, rates in (("mbm_total_bytes", t.mbm_total), ("mbm_local_bytes", t.mbm_local)):
                    for dom, rate in rates.items():
                        key = (dom, event)
                        g.counters[key] = (g.counters.get(key, 0) + int(round(rate * seconds))) % mod

    def set_status(self, group_path: str, domain: int, event: str, status: str | None) -> None:
        with self.lock:
            key = (group_path.strip("/"), domain, event)
            if status is None:
                self.status.pop(key, None)
            else:
                self.status[key] = status

    def set_counter(self, group_path: str, domain: int, event: str, value: int) -> None:
        with self.lock:
            self._group_at(group_path).counters[(domain, event)] = value % (1 << self.width_bits)

    def _group_at(self, path: str) -> Group:
        parts = [p for p in path.strip("/").split("/") if p]
        g = self.root
        if parts and parts[0] != "mon_groups":
            g = self.ctrls[parts.pop(0)]
        if parts:
            assert parts[0] == "mon_groups"
            g = g.mon_groups[parts[1]]
        return g

    def group_path(self, g: Group) -> str:
        if g.is_ctrl:
            return g.name
        return f"{g.ctrl.name}/mon_groups/{g.name}".lstrip("/")

    def _event_value(self, g: Group, dom: int, event: str) -> str:
        st = self.status.get((self.group_path(g), dom, event))
        if st:
            return st
        groups = [g] + (list(g.mon_groups.values()) if g.is_ctrl else [])
        if event == "llc_occupancy":
            owners = {id(x) for x in groups}
            return str(sum(t.occupancy.get(dom, 0) for tid, t in self.truth.items() if id(self.owner(tid)) in owners))
        return str(sum(x.counters.get((dom, event), 0) for x in groups) % (1 << self.width_bits))

    def _tasks_of(self, g: Group) -> list[int]:
        if g.is_ctrl:
            return sorted(t for t, c in self.task_ctrl.items() if c is g)
        return sorted(t for t, m in self.task_mon.items() if m is g)

    def _free_rmid(self, rmid: int) -> None:
        if self.limbo_seconds > 0:
            self.limbo.append((rmid, self.emulated_seconds + self.limbo_seconds))
        else:
            self.freed_rmids.append(rmid)

    def _alloc_rmid(self) -> int | None:
        self.freed_rmids += [r for r, until in self.limbo if until <= self.emulated_seconds]
        self.limbo = [(r, until) for r, until in self.limbo if until > self.emulated_seconds]
        if self.freed_rmids:
            return self.freed_rmids.pop(0)
        if self.next_rmid < self.num_rmids:
            self.next_rmid += 1
            return self.next_rmid - 1
        return None

    def used_rmids(self) -> int:
        return 1 + len(self.ctrls) + sum(len(c.mon_groups) for c in [self.root, *self.ctrls.values()])

    # -- the filesystem ----------------------------------------------------------------------------
    def _resolve(self, path: str):
        """('dir', names) | ('file', text, writable) for a path, or raise ENOENT."""
        parts = [p for p in path.split("/") if p]
        if parts and parts[0] == "info":
            return self._resolve_info(parts[1:])
        g = self.root
        if parts and parts[0] not in ("mon_groups", "mon_data", "tasks", "cpus", "cpus_list", "schemata"):
            if parts[0] not in self.ctrls:
                raise _enoent()
            g = self.ctrls[parts.pop(0)]
        if g.is_ctrl and parts[:1] == ["mon_groups"] and self.monitoring:
            if len(parts) == 1:
                return ("dir", sorted(g.mon_groups))
            if parts[1] not in g.mon_groups:
                raise _enoent()
            g = g.mon_groups[parts[1]]
            parts = parts[2:]
        return self._resolve_group(g, parts)

    def _resolve_group(self, g: Group, parts: list[str]):
        files = ["tasks", "cpus", "cpus_list"] + (["schemata"] if g.is_ctrl and self.allocation else [])
        dirs = (["mon_data"] if self.monitoring else []) + (["mon_groups"] if g.is_ctrl and self.monitoring else [])
        if not parts:
            top = (["info"] + sorted(self.ctrls)) if g is self.root else []
            return ("dir", files + dirs + top)
        if len(parts) == 1 and parts[0] in files:
            if parts[0] == "tasks":
                return ("file", "".join(f"{t}\n" for t in self._tasks_of(g)), True)
            if parts[0] == "schemata":
                return ("file", self.rules.render(self.schemata[g.name]), True)
            return ("file", "\n", True)
        if parts[0] == "mon_data" and self.monitoring:
            doms = {f"mon_L3_{d:02d}": d for d in self.domains}
            if len(parts) == 1:
                return ("dir", sorted(doms))
            if parts[1] not in doms:
                raise _enoent()
            if len(parts) == 2:
                return ("dir", list(self.features))
            if len(parts) == 3 and parts[2] in self.features:
                return ("file", self._event_value(g, doms[parts[1]], parts[2]) + "\n", False)
        raise _enoent()

    def _resolve_info(self, parts: list[str]):
        tree: dict[str, dict[str, str]] = {}
        if self.monitoring:
            tree["L3_MON"] = {"num_rmids": f"{self.num_rmids}\n",
                              "mon_features": "".join(f"{f}\n" for f in self.features),
                              "max_threshold_occupancy": "1048576\n"}
        tree.update(self.rules.info(self.allocation))
        if not parts:
            return ("dir", ["last_cmd_status"] + sorted(tree))
        if parts == ["last_cmd_status"]:
            return ("file", self.last_cmd_status + "\n", False)
        if parts[0] in tree:
            if len(parts) == 1:
                return ("dir", sorted(tree[parts[0]]))
            if len(parts) == 2 and parts[1] in tree[parts[0]]:
                return ("file", tree[parts[0]][parts[1]], False)
        raise _enoent()

    def _fail(self, err: int, msg: str):
        import mfusepy

        self.last_cmd_status = msg
        return mfusepy.FuseOSError(err)

    def operations(self):
        import mfusepy

        emu = self

        class Ops(mfusepy.Operations):
            use_ns = True

            def getattr(self, path, fh=None):
                with emu.lock:
                    node = emu._resolve(path)
                now = time.time_ns()
                if node[0] == "dir":
                    return dict(st_mode=stat.S_IFDIR | 0o755, st_nlink=2, st_atime=now, st_mtime=now, st_ctime=now)
                mode = 0o644 if node[2] else 0o444
                return dict(st_mode=stat.S_IFREG | mode, st_nlink=1, st_size=len(node[1].encode()),
                            st_atime=now, st_mtime=now, st_ctime=now)

            def readdir(self, path, fh):
                with emu.lock:
                    node = emu._resolve(path)
                if node[0] != "dir":
                    raise mfusepy.FuseOSError(errno.ENOTDIR)
                return [".", ".."] + node[1]

            def open(self, path, flags):
                with emu.lock:
                    node = emu._resolve(path)
                if node[0] == "dir":
                    raise mfusepy.FuseOSError(errno.EISDIR)
                if flags & (os.O_WRONLY | os.O_RDWR) and not node[2]:
                    raise mfusepy.FuseOSError(errno.EACCES)
                return 0

            def read(self, path, size, offset, fh):
                if path is None:
                    # A file read through a descriptor kept open after its group was removed: kernfs answers
                    # ENODEV for a removed node.
                    raise mfusepy.FuseOSError(errno.ENODEV)
                with emu.lock:
                    node = emu._resolve(path)
                return node[1].encode()[offset:offset + size]

            def truncate(self, path, length, fh=None):
                return 0

            def write(self, path, data, offset, fh):
                with emu.lock:
                    return emu._write(path, data)

            def mkdir(self, path, mode):
                with emu.lock:
                    emu._mkdir(path)
                return 0

            def rmdir(self, path):
                with emu.lock:
                    emu._rmdir(path)
                return 0

            def chmod(self, path, mode):
                raise mfusepy.FuseOSError(errno.EPERM)

            def utimens(self, path, times=None):
                return 0

        return Ops()

    def _write(self, path: str, data: bytes) -> int:
        parts = [p for p in path.split("/") if p]
        if parts[-1] == "schemata":
            name = parts[0] if len(parts) == 2 else ""
            self.commands.append(f"write {path} {data.decode(errors='replace').strip()}")
            try:
                self.schemata[name] = self.rules.apply(self.schemata[name], data.decode(errors="replace"))
            except AllocError as e:
                raise self._fail(e.errno, e.status) from None
            self.last_cmd_status = "ok"
            return len(data)
        if parts[-1] != "tasks":
            raise self._fail(errno.EINVAL, "unsupported write")
        g = self._group_at("/".join(parts[:-1]))
        self.commands.append(f"write {path} {data.decode(errors='replace').strip()}")
        text = data.decode(errors="replace").strip()
        try:
            tid = int(text)
        except ValueError:
            raise self._fail(errno.EINVAL, f"invalid task id {text!r}") from None
        if tid <= 0 or (self.known_tasks is not None and tid not in self.known_tasks):
            raise self._fail(errno.ESRCH, f"No task {tid}")
        if g.is_ctrl:
            self.task_ctrl[tid] = g
            self.task_mon.pop(tid, None)
        else:
            if (self.task_ctrl.get(tid) or self.root) is not g.ctrl:
                raise self._fail(errno.EINVAL, "Can't move task to different control group")
            self.task_mon[tid] = g
        self.last_cmd_status = "ok"
        return len(data)

    def _mkdir(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        self.commands.append(f"mkdir {path}")
        if len(parts) == 1:
            if parts[0] in ("info", "mon_groups", "mon_data") or parts[0] in self.ctrls:
                raise self._fail(errno.EEXIST, "")
            if not self.allocation:
                raise self._fail(errno.EPERM, "")  # no CLOSIDs to give without allocation
            if 1 + len(self.ctrls) >= self.rules.num_closids(self.allocation):
                raise self._fail(errno.ENOSPC, "Out of CLOSIDs")
            rmid = self._alloc_rmid() if self.monitoring else 0
            if rmid is None:
                raise self._fail(errno.ENOSPC, "Out of RMIDs")
            self.ctrls[parts[0]] = Group(parts[0], None, rmid)
            self.schemata[parts[0]] = self.rules.defaults(self.allocation, self.domains)
        elif (len(parts) == 2 and parts[0] == "mon_groups") or (len(parts) == 3 and parts[1] == "mon_groups"
                                                                  and parts[0] in self.ctrls):
            if not self.monitoring:
                raise _enoent()
            ctrl = self.root if len(parts) == 2 else self.ctrls[parts[0]]
            if parts[-1] in ctrl.mon_groups:
                raise self._fail(errno.EEXIST, "")
            rmid = self._alloc_rmid()
            if rmid is None:  # monitor.c alloc_rmid(): -EBUSY while some are in limbo, else -ENOSPC
                raise self._fail(errno.EBUSY if self.limbo else errno.ENOSPC, "Out of RMIDs")
            ctrl.mon_groups[parts[-1]] = Group(parts[-1], ctrl, rmid)
        else:
            raise self._fail(errno.EPERM, "")
        self.last_cmd_status = "ok"

    def _rmdir(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        self.commands.append(f"rmdir {path}")
        if len(parts) == 1 and parts[0] in self.ctrls:
            g = self.ctrls.pop(parts[0])
            self.schemata.pop(parts[0], None)
            for m in g.mon_groups.values():
                self._free_rmid(m.rmid)
            self._free_rmid(g.rmid)
            for t in [t for t, c in self.task_ctrl.items() if c is g]:
                del self.task_ctrl[t]  # back to the root group
                self.task_mon.pop(t, None)
        elif parts[-2:-1] == ["mon_groups"] and len(parts) in (2, 3):
            ctrl = self.root if len(parts) == 2 else self.ctrls.get(parts[0])
            if ctrl is None or parts[-1] not in ctrl.mon_groups:
                raise _enoent()
            g = ctrl.mon_groups.pop(parts[-1])
            self._free_rmid(g.rmid)
            for t in [t for t, m in self.task_mon.items() if m is g]:
                del self.task_mon[t]  # tasks go to the parent CTRL_MON group
        else:
            raise self._fail(errno.EPERM, "")
        self.last_cmd_status = "ok"

    # -- mounting ----------------------------------------------------------------------------------
    def mount(self, mountpoint: Path, cache_seconds: float = 0.0) -> ResctrlEmulator:
        """Mount at ``mountpoint``. ``cache_seconds`` > 0 lets the kernel cache names and attributes (as it
        does for the real, kernfs-backed resctrl), so a path walk does not ask this process every time:
        for benchmarks. Tests keep 0, so every lookup sees the emulator's current tree."""
        import mfusepy

        mountpoint = Path(mountpoint)
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.mountpoint = mountpoint
        ops = self.operations()

        def run():
            mfusepy.FUSE(ops, str(mountpoint), foreground=True, nothreads=False, direct_io=True,
                         attr_timeout=cache_seconds, entry_timeout=cache_seconds, negative_timeout=0,
                         fsname="resctrl-emulator")

        self._thread = threading.Thread(target=run, name="resctrl-fuse", daemon=True)
        self._thread.start()
        deadline = time.time() + 10
        while not os.path.ismount(mountpoint):
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"FUSE resctrl emulator did not mount at {mountpoint}")
            time.sleep(0.02)
        return self

    def unmount(self) -> None:
        if self.mountpoint is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.umount2(str(self.mountpoint).encode(), MNT_DETACH) != 0:
            e = ctypes.get_errno()
            if e not in (errno.EINVAL, errno.ENOENT):
                raise OSError(e, f"umount2 {self.mountpoint}: {os.strerror(e)}")
        if self._thread:
            self._thread.join(timeout=10)
        self.mountpoint = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unmount()
