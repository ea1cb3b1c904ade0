"""Attribute eBPF counts to containers: by cgroup id, or by process id where cgroup ids mean nothing.

**cgroup id.** ``bpf_get_current_cgroup_id()`` returns the id of the task's cgroup on the default (v2)
hierarchy (kernel/bpf/helpers.c: ``cgroup_id(task_dfl_cgroup(current))``). That id is the cgroup
directory's kernfs node id, which is also its inode number on 64-bit kernels (include/linux/cgroup.h
cgroup_id(); fs/kernfs/kernfs-internal.h kernfs_ino(); readdir reports the same number,
fs/kernfs/dir.c kernfs_fop_readdir()). So one walk of the v2 tree maps every live id to a path. This holds
on pure v2 hosts and on hybrid hosts, where the v2 tree is mounted at ``<cgroup root>/unified`` next to the
v1 controllers (runc also places containers there).

**pid.** On v1-only hosts every task sits in the root of the (unmounted) default hierarchy, so the
program keys by tgid as well and the container comes from ``/proc/<tgid>/cgroup``: lines
``hierarchy-ID:controller-list:cgroup-path`` (Documentation/admin-guide/cgroup-v1/cgroups.rst, 1.3 "How
are cgroups implemented?"; man 7 cgroups, "/proc/[pid]/cgroup"; the v2 line is ``0::<path>``,
Documentation/admin-guide/cgroup-v2.rst, "Processes"). Paths are relative to the reader's cgroup
namespace, so the agent must run in the host's.

Tasks in a sub-cgroup of a container (e.g. systemd inside it) belong to the nearest container above.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..sysfs import read_text
from .identity import ContainerIdentity

MAX_WALK_DEPTH = 16


def scan_cgroup_ids(v2_root: Path, max_depth: int = MAX_WALK_DEPTH) -> dict[int, str]:
    """Inode (= cgroup id) of every directory of a v2 tree, mapped to its path relative to the root
    (``/`` for the root itself). Directories removed while walking are skipped."""
    root_s = str(v2_root)
    out: dict[int, str] = {}
    try:
        out[os.stat(root_s).st_ino] = "/"
    except OSError:
        return out

    def walk(d: str, depth: int) -> None:
        try:
            it = os.scandir(d)
        except OSError:
            return
        with it:
            for e in it:
                try:
                    if not e.is_dir(follow_symlinks=False):
                        continue
                    ino = e.inode()  # d_ino from getdents: no extra stat per directory
                except OSError:
                    continue
                out[ino] = e.path[len(root_s):]
                if depth < max_depth:
                    walk(e.path, depth + 1)

    walk(root_s, 0)
    return out


def owning_container(path: str, by_path: dict[str, ContainerIdentity]) -> ContainerIdentity | None:
    """The container whose cgroup is ``path`` or its nearest ancestor."""
    p = "/" + path.strip("/")
    while True:
        ident = by_path.get(p)
        if ident is not None:
            return ident
        if p == "/":
            return None
        p = p.rsplit("/", 1)[0] or "/"


@dataclass(frozen=True)
class ProcCgroup:
    hierarchy_id: int
    controllers: tuple[str, ...]  # empty for the v2 line
    path: str


def parse_proc_cgroup(text: str) -> list[ProcCgroup]:
    """Parse /proc/<pid>/cgroup. The path may contain ':' (only the first two separate fields); lines that
    do not have three fields or a numeric id are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        try:
            hid = int(parts[0])
        except ValueError:
            continue
        ctrls = tuple(c for c in parts[1].split(",") if c)
        out.append(ProcCgroup(hid, ctrls, parts[2]))
    return out


def path_in_hierarchy(entries: list[ProcCgroup], controller: str | None) -> str | None:
    """The task's path in the v1 hierarchy that has ``controller`` (``None``: the v2 line)."""
    for e in entries:
        if controller is None and e.hierarchy_id == 0 and not e.controllers:
            return e.path
        if controller is not None and controller in e.controllers:
            return e.path
    return None


class CgroupIdResolver:
    """cgroup id -> container, from one walk of the v2 tree per :meth:`refresh`."""

    def __init__(self, v2_root: Path):
        self.v2_root = Path(v2_root)
        self.paths: dict[int, str] = {}
        self._owner: dict[int, ContainerIdentity | None] = {}

    def scan(self) -> dict[int, str]:
        """Walk the v2 tree once: every live cgroup id and its path."""
        self.paths = scan_cgroup_ids(self.v2_root)
        return self.paths

    def assign(self, containers: list[ContainerIdentity]) -> None:
        """Map the scanned ids to their containers."""
        by_path = {c.cgroup_path: c for c in containers}
        self._owner = {i: owning_container(p, by_path) for i, p in self.paths.items()}

    def refresh(self, containers: list[ContainerIdentity]) -> None:
        self.scan()
        self.assign(containers)

    def alive(self, cgroup_id: int) -> bool:
        return cgroup_id in self.paths

    def container(self, cgroup_id: int) -> ContainerIdentity | None:
        return self._owner.get(cgroup_id)


class PidResolver:
    """tgid -> container through ``<proc>/<tgid>/cgroup`` and the v1 hierarchy holding ``controller``."""

    def __init__(self, proc_root: Path, controller: str | None = "cpuacct"):
        self.proc_root = Path(proc_root)
        self.controller = controller
        self.by_path: dict[str, ContainerIdentity] = {}

    def refresh(self, containers: list[ContainerIdentity]) -> None:
        self.by_path = {c.cgroup_path: c for c in containers}

    def alive(self, tgid: int) -> bool:
        # tgid 0 is the idle task (swapper), which has no /proc entry and never exits.
        return tgid == 0 or (self.proc_root / str(tgid)).is_dir()

    def cgroup_path(self, tgid: int) -> str | None:
        text = read_text(self.proc_root / str(tgid) / "cgroup")
        if text is None:
            return None
        return path_in_hierarchy(parse_proc_cgroup(text), self.controller)

    def container(self, tgid: int) -> ContainerIdentity | None:
        if tgid == 0:
            return None
        path = self.cgroup_path(tgid)
        return owning_container(path, self.by_path) if path is not None else None
