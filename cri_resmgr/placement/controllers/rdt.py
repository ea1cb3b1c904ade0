"""RDT allocation classes on resctrl: one CTRL_MON group per class, its schemata from :mod:`.schemata`.

Documentation/arch/x86/resctrl.rst: ``mkdir <resctrl>/<group>`` makes a control group (ENOSPC when the
CLOSIDs are used up), writing its ``schemata`` sets its allocation, and writing a thread id to its ``tasks``
moves that thread (not its whole process: "only the task ID is moved"), so every thread of the container's
cgroup is written; threads forked later inherit the group. A refused write leaves the reason in
``info/last_cmd_status``, which every error here quotes (the ancestor's issue "RDT: include
info/last_cmd_status in error messages"). The class ``system/default`` configures the root group.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from ... import metrics as M
from ...config import RdtControlConfig
from ..context import ContainerContext
from .base import ControlError, ControlType, NoCgroupYet, Plan
from .cgroups import container_hierarchy, describe, write_file
from .schemata import ROOT_CLASS, BandwidthInfo, CacheInfo, ClassSchemata, ResctrlInfo, compute_schemata, features


def _read(path: Path) -> str:
    return path.read_text().strip()


def parse_size(text: str) -> int | None:
    """sysfs cache ``size`` (``32768K``; Documentation/ABI/testing/sysfs-devices-system-cpu) in bytes."""
    t = text.strip().upper()
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(t[-1:], 1)
    try:
        return int(t.rstrip("KMG")) * mult
    except ValueError:
        return None


def schemata_domains(text: str, resource: str) -> tuple[int, ...]:
    """Cache ids of a resource's line in a schemata file (``L3:0=fff;1=fff`` -> (0, 1))."""
    for line in text.splitlines():
        name, _, rest = line.strip().partition(":")
        if name.strip() == resource:
            return tuple(sorted(int(x.split("=")[0]) for x in rest.split(";") if "=" in x))
    return ()


class RdtController(ControlType[RdtControlConfig]):
    name = "rdt"
    class_metric = M.CONTAINER_RDT_CLASS

    def __init__(self, resctrl: Path, sysfs: Path = Path("/sys"), proc: Path = Path("/proc"),
                 cgroup_root: Path = Path("/sys/fs/cgroup")):
        self.root = Path(resctrl)
        self.sysfs = Path(sysfs)
        self.proc = Path(proc)
        self.cgroup_root = Path(cgroup_root)
        self.created: set[str] = set()  # groups of configured classes (the only ones it ever removes)

    # -- what resctrl offers ------------------------------------------------------------------------
    def mounted_mbps(self) -> bool | None:
        """mba_MBps from the resctrl mount's super options in mountinfo (proc(5)); None when not found."""
        try:
            lines = (self.proc / "self" / "mountinfo").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            pre, _, post = line.partition(" - ")
            fields = pre.split()
            if len(fields) > 4 and fields[4] == str(self.root) and post.startswith("resctrl "):
                return "mba_MBps" in post.split()[-1].split(",")
        return None

    def probe(self, l3_cache_bytes: int | None) -> ResctrlInfo | None:
        info = self.root / "info"
        if not info.is_dir():
            return None
        try:
            root_schemata = _read(self.root / "schemata")
        except OSError:
            root_schemata = ""
        cdp = (info / "L3CODE").is_dir()
        l3dir = info / ("L3CODE" if cdp else "L3")
        l3: CacheInfo | None = None
        if l3dir.is_dir():
            size = l3_cache_bytes
            if size is None:
                try:
                    size = parse_size(_read(self.sysfs / "devices/system/cpu/cpu0/cache/index3/size"))
                except OSError:
                    size = None
            l3 = CacheInfo(cbm_bits=int(_read(l3dir / "cbm_mask"), 16).bit_length(),
                           min_cbm_bits=int(_read(l3dir / "min_cbm_bits")),
                           num_closids=int(_read(l3dir / "num_closids")),
                           domains=schemata_domains(root_schemata, "L3CODE" if cdp else "L3"),
                           shareable_bits=int(_read(l3dir / "shareable_bits") or "0", 16)
                           if (l3dir / "shareable_bits").exists() else 0,
                           cache_bytes=size)
        mb: BandwidthInfo | None = None
        if (info / "MB").is_dir():
            domains = schemata_domains(root_schemata, "MB")
            mbps = self.mounted_mbps()
            if mbps is None:  # not found in mountinfo (e.g. an emulator): the default MB value tells
                mbps = any(int(v.split("=")[1]) > 100 for line in root_schemata.splitlines()
                           if line.startswith("MB:") for v in line[3:].split(";") if "=" in v)
            mb = BandwidthInfo(min_bandwidth=int(_read(info / "MB" / "min_bandwidth")),
                               bandwidth_gran=int(_read(info / "MB" / "bandwidth_gran")),
                               num_closids=int(_read(info / "MB" / "num_closids")), domains=domains, mbps=mbps)
        return ResctrlInfo(l3, mb, cdp)

    def last_cmd_status(self) -> str:
        try:
            return _read(self.root / "info" / "last_cmd_status")
        except OSError:
            return "(info/last_cmd_status unreadable)"

    # -- prepare / commit ---------------------------------------------------------------------------
    def prepare(self, section: RdtControlConfig) -> Plan[RdtControlConfig] | list[str]:
        classes = tuple(section.class_names())
        if not classes:
            return Plan(section, ())
        try:
            info = self.probe(section.l3_cache_bytes)
        except (OSError, ValueError) as e:
            return [f"controls.rdt: cannot read {self.root}/info: {e}"]
        if info is None:
            needed = [f"controls.rdt.{f}: on, but resctrl is not mounted at {self.root}"
                      for f in ("l3", "mb", "cdp") if getattr(section, f) == "on"]
            needed += [f"controls.rdt.partitions.{p}.classes.{c}.required: {', '.join(cl.required)} required, "
                       f"but resctrl is not mounted at {self.root}"
                       for p, part in section.partitions.items() for c, cl in part.classes.items() if cl.required]
            if needed:
                return needed
            return Plan(section, classes, None, (f"resctrl is not mounted at {self.root}: RDT classes are recorded "
                                                 "but not enforced",))
        schemata, problems = compute_schemata(section, info)
        if problems:
            return problems
        feats, _ = features(section, info)
        if not feats.l3 and not feats.mb:  # e.g. an MBM-only system: no CLOSIDs to give, nothing to write
            return Plan(section, classes, None, ("no RDT allocation available or enabled (l3, mb): classes are "
                                                 "recorded but not enforced",))
        notes = tuple(f"class {n}: {note}" for n, s in schemata.items() for note in s.notes)
        return Plan(section, classes, schemata, notes)

    def group_dir(self, cls: str) -> Path:
        return self.root if cls == ROOT_CLASS else self.root / cls

    def commit(self, plan: Plan[RdtControlConfig]) -> list[str]:
        schemata: dict[str, ClassSchemata] | None = plan.details
        if schemata is None:
            return []
        problems: list[str] = []
        for name, cs in schemata.items():
            d = self.group_dir(name)
            key = f"controls.rdt.partitions.{cs.partition}.classes.{name}"
            if not d.is_dir():
                try:
                    os.mkdir(d)
                except OSError as e:
                    problems.append(f"{key}: mkdir {d}: {describe(e)}: {self.last_cmd_status()}")
                    continue
            if name != ROOT_CLASS:
                self.created.add(name)  # a class's group is ours, also when an earlier run made it
            for line in cs.lines:  # one line per write: last_cmd_status then names the line at fault
                try:
                    write_file(d / "schemata", line + "\n")
                except OSError as e:
                    problems.append(f"{key}: schemata {line!r}: {describe(e)}: {self.last_cmd_status()}")
        for name in sorted(self.created - schemata.keys()):  # classes that went away
            try:
                os.rmdir(self.group_dir(name))
                self.created.discard(name)
            except OSError as e:
                problems.append(f"controls.rdt: rmdir {self.group_dir(name)}: {describe(e)}")
        return problems

    # -- enforce ------------------------------------------------------------------------------------
    def thread_ids(self, ctx: ContainerContext) -> list[int]:
        """Every thread of the container: v1 ``tasks`` (thread ids), v2 ``cgroup.threads``."""
        for controller in ("cpu", "pids", "memory", "cpuacct"):
            h = container_hierarchy(self.cgroup_root, controller, ctx.cgroup_path)
            if h is not None:
                name = "tasks" if h.version == 1 else "cgroup.threads"
                return [int(x) for x in (h.dir_of(ctx.cgroup_path) / name).read_text().split()]
        raise NoCgroupYet(f"no cgroup {ctx.cgroup_path or '(unknown path)'} under {self.cgroup_root}")

    def enforce(self, ctx: ContainerContext, cls: str, plan: Plan[RdtControlConfig]) -> dict[str, Any]:
        if plan.details is None:
            return {"degraded": plan.notes[0] if plan.notes else "RDT allocation unavailable"}
        tasks = self.group_dir(cls) / "tasks"
        done: set[int] = set()
        # A thread created while the others are moved inherits its creator's group, which may be the old one:
        # read the list again until it holds nothing new (a few rounds at most).
        for _ in range(4):
            new = [tid for tid in self.thread_ids(ctx) if tid not in done]
            if not new:
                break
            for tid in new:
                try:
                    write_file(tasks, str(tid))
                except OSError as e:
                    if e.errno != errno.ESRCH:  # ESRCH: the thread exited meanwhile
                        raise ControlError(f"write {tid} to {tasks}: {describe(e)}: {self.last_cmd_status()}") from None
                done.add(tid)
        return {"group": str(self.group_dir(cls)), "threads": len(done)}
