"""Where a cgroup controller's files are, on cgroup v1, v2 and hybrid hosts.

v1 mounts each controller (or a comma-joined set) as a directory under the cgroup root
(Documentation/admin-guide/cgroup-v1/cgroups.rst); v2 has one tree whose ``cgroup.controllers`` lists what
is available (Documentation/admin-guide/cgroup-v2.rst, "Controlling Controllers"). A hybrid host mounts v2 at
``unified/``. Probed when asked, never at import.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 1 or 2
    root: Path  # container cgroup paths are relative to this

    def dir_of(self, cgroup_path: str) -> Path:
        return self.root / cgroup_path.strip("/") if cgroup_path.strip("/") else self.root


def _v2_controllers(root: Path) -> set[str]:
    try:
        return set((root / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def hierarchies(cgroup_root: Path, controller: str) -> list[Hierarchy]:
    """The hierarchies that carry ``controller``, v1 first (where a hybrid host's containers live)."""
    root = Path(cgroup_root)
    out: list[Hierarchy] = []
    if (root / "cgroup.controllers").exists():
        return [Hierarchy(2, root)] if controller in _v2_controllers(root) else []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    for name in names:
        if controller in name.split(",") and (root / name).is_dir():
            out.append(Hierarchy(1, root / name))
            break
    if controller in _v2_controllers(root / "unified"):
        out.append(Hierarchy(2, root / "unified"))
    return out


def container_hierarchy(cgroup_root: Path, controller: str, cgroup_path: str) -> Hierarchy | None:
    """The hierarchy where the container's cgroup exists for ``controller``."""
    for h in hierarchies(cgroup_root, controller):
        if cgroup_path and h.dir_of(cgroup_path).is_dir():
            return h
    return None


def write_file(path: Path, text: str) -> None:
    """One write(2) per call, as cgroup files take one command per write; OSError carries the errno."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def describe(e: OSError) -> str:
    return f"{errno.errorcode.get(e.errno or 0, 'E?')} ({e.strerror})"
