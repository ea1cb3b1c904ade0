"""Container discovery driven by change: inotify on the pod cgroup directories, one discovery for all
collectors.

A walk of the whole cgroup tree per collector per cycle costs in proportion to the node's size, even when
nothing changed. Here the tree is walked once; every non-container directory on the way (``kubepods``,
the QoS and pod directories, systemd slices) gets an inotify watch, and afterwards only the kernel's
events are read: ``IN_CREATE`` / ``IN_DELETE`` with ``IN_ISDIR`` when a cgroup is made or removed
(mkdir(2)/rmdir(2) on cgroupfs go through the VFS, which raises them: fs/namei.c ``vfs_mkdir`` ->
``fsnotify_mkdir``, ``vfs_rmdir`` -> ``fsnotify_rmdir``). A cycle without change costs one non-blocking
read(2) that answers EAGAIN.

inotify(7) is used through ctypes on libc's ``inotify_init1``/``inotify_add_watch``/``inotify_rm_watch``
(no maintained Python binding is installed here, and the three calls are a stable ABI; the constants are
from include/uapi/linux/inotify.h). Without inotify (ENOSYS, the per-user watch limit reached) the
discovery walks the tree on every call instead and says so in :attr:`ContainerDiscovery.mode`.

Events can be lost (``IN_Q_OVERFLOW``), so an overflow triggers a full rescan, as does a periodic
``resync_seconds`` safety net.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..libc import LIBC
from .identity import ContainerIdentity, is_container_dir, parse_container_path

log = logging.getLogger(__name__)

MAX_DEPTH = 8  # kubepods nesting is at most ~6 deep even under kubelet.slice in kind/minikube

# include/uapi/linux/inotify.h
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
WATCH_MASK = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # struct inotify_event: int wd; u32 mask, cookie, len; char name[len]
READ_SIZE = 1 << 16


def parse_events(buf: bytes) -> list[tuple[int, int, str]]:
    """Decode a read(2) of an inotify descriptor into ``(wd, mask, name)``; names are NUL-padded."""
    out = []
    off = 0
    while off + _EVENT.size <= len(buf):
        wd, mask, _cookie, n = _EVENT.unpack_from(buf, off)
        off += _EVENT.size
        name = buf[off:off + n].split(b"\0", 1)[0].decode(errors="replace")
        off += n
        out.append((wd, mask, name))
    return out


class _Inotify:
    """The three libc calls; raises OSError with the errno."""

    def __init__(self) -> None:
        self._add = LIBC.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._rm = LIBC.inotify_rm_watch
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        fd = LIBC.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        self.fd: int = fd

    def add(self, path: str) -> int:
        wd = self._add(self.fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
        return int(wd)

    def read(self) -> bytes:
        try:
            return os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        os.close(self.fd)


def _key(rel: str, ident: ContainerIdentity) -> str:
    """``rel`` as the key of a found container: the identity's own string where it is the same path (it is, but
    for doubled slashes), so a path is held once, not once more per discovery."""
    return ident.cgroup_path if ident.cgroup_path == rel else rel


class ContainerDiscovery:
    """Kubernetes container cgroups under ``root`` (paths relative to it), kept current by inotify.

    Thread-safe: every collector thread may call :meth:`containers`. :attr:`generation` grows whenever
    the set changes, so consumers can skip work when it did not.
    """

    def __init__(self, root: Path | str, resync_seconds: float = 300.0, use_inotify: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.root = str(root).rstrip("/") or "/"
        self.resync_seconds = resync_seconds
        self.clock = clock
        self.generation = 0
        self.mode = "not started"
        self.walks_total = 0  # full scans (the first, overflows, resyncs, or every call without inotify)
        self.events_total = 0
        self._use_inotify = use_inotify
        self._ino: _Inotify | None = None
        self._dirs: dict[int, str] = {}  # wd -> relative dir ("" for the root)
        self._wd_of: dict[str, int] = {}
        self._found: dict[str, ContainerIdentity] = {}  # relative path -> identity
        self._last_walk: float | None = None
        self._lock = threading.Lock()

    # -- public ------------------------------------------------------------------------------------
    def containers(self) -> list[ContainerIdentity]:
        with self._lock:
            self._update()
            return list(self._found.values())

    def poll(self) -> bool:
        """Apply pending changes; True when the set of containers changed."""
        with self._lock:
            g = self.generation
            self._update()
            return g != self.generation

    @property
    def watches(self) -> int:
        return len(self._dirs)

    def close(self) -> None:
        with self._lock:
            if self._ino is not None:
                self._ino.close()
                self._ino = None
            self._dirs.clear()
            self._wd_of.clear()
            self.mode = "closed"

    # -- inside ------------------------------------------------------------------------------------
    def _update(self) -> None:
        now = self.clock()
        if self._ino is None and self._use_inotify and self.mode != "walk":
            try:
                self._ino = _Inotify()
            except OSError as e:
                self.mode = "walk"
                log.warning("inotify unavailable (%s): container discovery walks the cgroup tree every cycle", e)
        if self._ino is None:
            self._rescan(watch=False)
            self.mode = "walk" if self._use_inotify else "walk (inotify off)"
            return
        if self._last_walk is None or now - self._last_walk >= self.resync_seconds:
            self._rescan(watch=True)
            self._last_walk = now
            return
        while True:
            buf = self._ino.read()
            if not buf:
                break
            if self._apply(parse_events(buf)):
                self._rescan(watch=True)
                self._last_walk = now
                break

    def _apply(self, events: list[tuple[int, int, str]]) -> bool:
        """Apply events; True when a full rescan is needed (queue overflow)."""
        for wd, mask, name in events:
            self.events_total += 1
            if mask & IN_Q_OVERFLOW:
                log.info("inotify queue overflowed: rescanning the cgroup tree")
                return True
            if mask & IN_IGNORED:
                d = self._dirs.pop(wd, None)
                if d is not None and self._wd_of.get(d) == wd:
                    del self._wd_of[d]
                continue
            parent = self._dirs.get(wd)
            if parent is None or not name or not mask & IN_ISDIR:
                continue
            rel = f"{parent}/{name}"
            if mask & (IN_CREATE | IN_MOVED_TO):
                self._added(rel, name)
            elif mask & (IN_DELETE | IN_MOVED_FROM):
                self._removed(rel)
        return False

    def _added(self, rel: str, name: str) -> None:
        if is_container_dir(name):
            ident = parse_container_path(rel)
            if ident is not None and rel not in self._found:
                self._found[_key(rel, ident)] = ident
                self.generation += 1
            return
        depth = rel.count("/")
        if depth <= MAX_DEPTH:
            # Watch first, then walk: a child made between the two is then seen by one or the other.
            self._walk(rel, depth, watch=True, into=self._found)

    def _removed(self, rel: str) -> None:
        if self._found.pop(rel, None) is not None:
            self.generation += 1
            return
        prefix = rel + "/"
        gone = [p for p in self._found if p.startswith(prefix)]
        for p in gone:
            del self._found[p]
        if gone:
            self.generation += 1
        for d in [d for d in self._wd_of if d == rel or d.startswith(prefix)]:
            self._dirs.pop(self._wd_of.pop(d), None)

    def _watch(self, rel: str) -> None:
        if self._ino is None or rel in self._wd_of:
            return
        try:
            wd = self._ino.add(self.root + rel)
        except OSError as e:
            if e.errno == errno.ENOSPC:  # fs.inotify.max_user_watches reached
                log.warning("inotify watch limit reached at %s%s: falling back to walking", self.root, rel)
                self._ino.close()
                self._ino = None
                self._dirs.clear()
                self._wd_of.clear()
                self.mode = "walk"
            return  # ENOENT: removed meanwhile
        self._dirs[wd] = rel
        self._wd_of[rel] = wd

    def _walk(self, rel: str, depth: int, watch: bool, into: dict[str, ContainerIdentity]) -> None:
        if watch:
            self._watch(rel)
        try:
            it = os.scandir(self.root + rel)
        except OSError:
            return  # removed while walking, or not readable
        with it:
            for e in it:
                try:
                    if not e.is_dir(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                sub = f"{rel}/{e.name}"
                if is_container_dir(e.name):
                    if sub not in into:
                        ident = parse_container_path(sub)
                        if ident is not None:
                            into[_key(sub, ident)] = ident
                            if into is self._found:
                                self.generation += 1
                    continue
                if depth < MAX_DEPTH:
                    self._walk(sub, depth + 1, watch, into)

    def _rescan(self, watch: bool) -> None:
        found: dict[str, ContainerIdentity] = {}
        self.walks_total += 1
        self._walk("", 0, watch and self._ino is not None, found)
        if watch and self._ino is not None:
            self.mode = "inotify"
        if found.keys() != self._found.keys():
            self.generation += 1
        self._found = found
