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

import ctypes
import errno
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..libc import LIBC
from ..sysfs import read_text
from .identity import ContainerIdentity

log = logging.getLogger(__name__)

MAX_WALK_DEPTH = 16
# Ids the last walk did not see that one refresh looks up by file handle (~7 µs each); the rest wait for a walk.
HANDLE_LOOKUPS_PER_RUN = 256


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


# -- cgroup id -> path by file handle ------------------------------------------------------------------
FILEID_KERNFS = 0xFE  # include/linux/exportfs.h: a kernfs node id, 8 bytes (cgroup2's file handles)
_AT_FDCWD = -100


class _FileHandle(ctypes.Structure):
    """struct file_handle (open_by_handle_at(2)) with room for a kernfs handle."""

    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int), ("f_handle", ctypes.c_ubyte * 8)]


OUTSIDE = ""  # CgroupHandles.lookup: a live cgroup outside the tree the handles were opened for


class CgroupHandles:
    """A cgroup id's path without walking the tree. cgroup2 exports its directories by file handle, and the
    handle is the kernfs node id, which is the cgroup id (fs/kernfs/mount.c: ``kernfs_encode_fh`` writes the
    node id, type FILEID_KERNFS). open_by_handle_at(2) opens the directory (it needs CAP_DAC_READ_SEARCH) and
    its /proc/self/fd link names it; an id no live cgroup has answers ESTALE. ~7 µs a lookup, where a walk of a
    node with 1,000 containers takes ~20 ms."""

    def __init__(self, mount_fd: int, prefix: str):
        self._fd = mount_fd
        self._prefix = prefix

    @classmethod
    def open(cls, v2_root: Path) -> tuple[CgroupHandles | None, str]:
        """Handles for the v2 tree at ``v2_root``, or None and why not (not cgroup2's handles there, no
        CAP_DAC_READ_SEARCH, no such calls in the C library)."""
        if not hasattr(LIBC, "open_by_handle_at") or not hasattr(LIBC, "name_to_handle_at"):
            return None, "the C library has no open_by_handle_at"
        root = os.fsencode(v2_root)
        fh, mount_id = _FileHandle(), ctypes.c_int()
        fh.handle_bytes = 8
        if LIBC.name_to_handle_at(_AT_FDCWD, root, ctypes.byref(fh), ctypes.byref(mount_id), 0) != 0:
            return None, f"no file handle for {v2_root}: {os.strerror(ctypes.get_errno())}"
        try:
            ino = os.stat(v2_root).st_ino
        except OSError as e:
            return None, f"{v2_root}: {e.strerror}"
        if (fh.handle_type != FILEID_KERNFS or fh.handle_bytes != 8
                or int.from_bytes(bytes(fh.f_handle), "little") != ino):
            return None, f"{v2_root} is not a cgroup2 tree (its file handles are not cgroup ids)"
        try:
            fd = os.open(v2_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            return None, f"{v2_root}: {e.strerror}"
        try:
            h = cls(fd, os.readlink(f"/proc/self/fd/{fd}"))
            if h.lookup(ino) != "/":
                raise OSError(errno.EIO, "the tree's own id does not name it")
        except OSError as e:  # EPERM: no CAP_DAC_READ_SEARCH
            os.close(fd)
            return None, f"open_by_handle_at on {v2_root}: {e.strerror}"
        return h, "ok"

    def lookup(self, cgroup_id: int) -> str | None:
        """The path of the live cgroup ``cgroup_id`` relative to the tree (``/``: the tree itself), ``OUTSIDE``
        for a live cgroup elsewhere in the hierarchy, None when no live cgroup has that id. OSError for any
        other failure."""
        if not 0 <= cgroup_id < 1 << 64:
            return None
        fh = _FileHandle(8, FILEID_KERNFS)
        fh.f_handle[:] = cgroup_id.to_bytes(8, "little")
        fd = LIBC.open_by_handle_at(self._fd, ctypes.byref(fh), os.O_PATH | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            if err in (errno.ESTALE, errno.ENOENT):
                return None
            raise OSError(err, os.strerror(err))
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        if path.endswith(" (deleted)"):  # removed since it was opened
            return None
        if path == self._prefix:
            return "/"
        if path.startswith(self._prefix + "/") or self._prefix == "/":
            return "/" + path[len(self._prefix):].lstrip("/")
        return OUTSIDE

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class CgroupIdResolver:
    """cgroup id -> container, from one walk of the v2 tree per :meth:`refresh`, and by file handle
    (:class:`CgroupHandles`) for ids made since the walk (:meth:`lookup`)."""

    def __init__(self, v2_root: Path):
        self.v2_root = Path(v2_root)
        self.paths: dict[int, str] = {}
        self._owner: dict[int, ContainerIdentity | None] = {}
        self._by_path: dict[str, ContainerIdentity] = {}
        self._handles: CgroupHandles | None = None
        self._handles_tried = False
        self.handles_reason = "not tried"
        self.handle_lookups_total = 0

    def scan(self) -> dict[int, str]:
        """Walk the v2 tree once: every live cgroup id and its path."""
        self.paths = scan_cgroup_ids(self.v2_root)
        return self.paths

    def assign(self, containers: list[ContainerIdentity]) -> None:
        """Map the scanned ids to their containers."""
        by_path = self._by_path = {c.cgroup_path: c for c in containers}
        self._owner = {i: owning_container(p, by_path) for i, p in self.paths.items()}

    @property
    def handles(self) -> CgroupHandles | None:
        """File handles for the tree, opened on first use (None where this host or process has none)."""
        if not self._handles_tried:
            self._handles_tried = True
            self._handles, self.handles_reason = CgroupHandles.open(self.v2_root)
            if self._handles is None:
                log.info("cgroup ids made between walks wait for the next walk: %s", self.handles_reason)
        return self._handles

    def lookup(self, ids: Iterable[int], limit: int = HANDLE_LOOKUPS_PER_RUN) -> set[int]:
        """Settle ids the last walk did not see by file handle: a live cgroup's id joins :attr:`paths` with its
        container (or none), an id no live cgroup has stays out (not :meth:`alive`). Returns the ids left
        unsettled (no handles here, past ``limit``, a failed call): they wait for the next walk."""
        pending = set(ids)
        h = self.handles if pending else None
        if h is None:
            return pending
        for i in list(pending)[:limit]:
            try:
                p = h.lookup(i)
            except OSError as e:  # not ESTALE: the handles are unusable (a capability dropped?): walks only
                self._handles_failed(h, e)
                return pending
            pending.discard(i)
            self.handle_lookups_total += 1
            if p is not None:
                self.paths[i] = p
                self._owner[i] = owning_container(p, self._by_path) if p != OUTSIDE else None
        return pending

    def recheck(self, ids: Iterable[int], limit: int = HANDLE_LOOKUPS_PER_RUN) -> bool:
        """Ask by file handle whether the cgroups ``ids`` (known from a walk or a lookup) still live: one that
        went away leaves :attr:`paths` (no longer :meth:`alive`), so its counts are retired. It spares a walk
        of the whole tree when what is asked is only which of the counted ids went away. False, with nothing
        changed, when that cannot be answered here (no handles, more than ``limit`` ids, a failed call): a
        walk must answer it."""
        todo = [i for i in ids if i in self.paths]
        h = self.handles
        if h is None or len(todo) > limit:
            return False
        gone = []
        for i in todo:
            try:
                p = h.lookup(i)
            except OSError as e:
                self._handles_failed(h, e)
                return False
            self.handle_lookups_total += 1
            if p is None:
                gone.append(i)
        for i in gone:
            del self.paths[i]
            self._owner.pop(i, None)
        return True

    def _handles_failed(self, h: CgroupHandles, e: OSError) -> None:
        log.warning("looking up cgroup ids by file handle failed (%s): walks only from now on", e)
        h.close()
        self._handles, self.handles_reason = None, f"open_by_handle_at failed: {e.strerror}"

    def close(self) -> None:
        if self._handles is not None:
            self._handles.close()
            self._handles = None

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
