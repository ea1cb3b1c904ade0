"""Real cgroup v1 directories for the controller tests (tests/test_controller_*.py), removed afterwards.

Each sandbox is a private top-level cgroup ``crirm-ctl-<pid>-<n>`` in the hierarchies it is asked for, so
tests never touch another test's (or engineer's) cgroups. Tasks still in a cgroup at cleanup are moved to
the hierarchy root first (rmdir needs an empty cgroup)."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_resmgr.placement.context import ContainerContext
from cri_resmgr.placement.model import Kind

CGROUP = Path("/sys/fs/cgroup")
_n = itertools.count()


def v1_hierarchy(controller: str) -> Path | None:
    d = CGROUP / controller
    return d if (d / "cgroup.procs").exists() and not (d / "cgroup.controllers").exists() else None


def unavailable(*controllers: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root to create cgroups"
    for c in controllers:
        if v1_hierarchy(c) is None:
            return f"no cgroup v1 {c} hierarchy at {CGROUP / c}"
    return None


@contextlib.contextmanager
def loop_device(tmp: Path, size: int) -> Iterator[tuple[str, str]]:
    """A loop device over a sparse file of ``size`` bytes: its path and ``major:minor``; detached afterwards.
    Skips the test with the reason where there is none to be had."""
    if os.geteuid() != 0 or not Path("/dev/loop-control").exists() or not shutil.which("losetup"):
        pytest.skip("needs root, /dev/loop-control and losetup (Debian package mount)")
    img = tmp / "disk.img"
    with open(img, "wb") as f:
        f.truncate(size)
    dev = subprocess.run(["losetup", "--find", "--show", str(img)], check=True, capture_output=True,
                         text=True).stdout.strip()
    try:
        st = os.stat(dev)
        yield dev, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


_bfq_reason: list[str | None] = []


def bfq_missing() -> str | None:
    """Why the v1 blkio hierarchy has no proportional weight (``blkio.bfq.weight``), or None when it has one.
    Kernels differ between machines of this kind: one was built with BFQ, another without
    (``# CONFIG_IOSCHED_BFQ is not set``). A BFQ module is loaded when there is one."""
    if not _bfq_reason:
        weight = CGROUP / "blkio" / "blkio.bfq.weight"
        if not weight.exists() and os.geteuid() == 0:
            with contextlib.suppress(OSError):
                subprocess.run(["modprobe", "bfq"], capture_output=True, timeout=20, check=False)
        _bfq_reason.append(None if weight.exists() else
                           "this kernel has no BFQ I/O scheduler (CONFIG_IOSCHED_BFQ), so no blkio.bfq.weight")
    return _bfq_reason[0]


class Sandbox:
    def __init__(self, controllers: tuple[str, ...]):
        self.top = f"crirm-ctl-{os.getpid()}-{next(_n)}"
        self.controllers = controllers
        self.made: list[Path] = []
        for c in controllers:
            self.mkdir(c, "")

    def mkdir(self, controller: str, rel: str) -> Path:
        d = CGROUP / controller / self.top / rel if rel else CGROUP / controller / self.top
        d.mkdir(parents=True, exist_ok=True)
        if d not in self.made:
            self.made.append(d)
        return d

    def container(self, pod: str, cid: str) -> str:
        """A container cgroup path ``/<top>/<pod>/<cid>`` made in every hierarchy."""
        for c in self.controllers:
            self.mkdir(c, f"{pod}/{cid}")
        return f"/{self.top}/{pod}/{cid}"

    def dir(self, controller: str, path: str = "") -> Path:
        return CGROUP / controller / path.strip("/") if path else CGROUP / controller / self.top

    def cleanup(self) -> None:
        for c in self.controllers:
            base = CGROUP / c / self.top
            if not base.exists():
                continue
            dirs = sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [base]
            for d in dirs:
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (CGROUP / c / "cgroup.procs").write_text(pid)
                d.rmdir()


def context(cgroup_path: str, name: str = "app", pod: str = "pod", qos: str = "Burstable",
            annotations: dict[str, str] | None = None, cid: str | None = None) -> ContainerContext:
    cid = cid or cgroup_path.rsplit("/", 1)[-1]
    return ContainerContext(id=cid, name=name, pod_id=f"sandbox-{pod}", pod_name=pod, pod_namespace="default",
                            pod_uid=f"uid-{pod}", annotations=dict(annotations or {}), effective={},
                            qos_class=qos, cgroup_parent=cgroup_path.rsplit("/", 1)[0], cgroup_path=cgroup_path,
                            cpus="", mems="", kind=Kind.SHARED)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text parsed by prometheus_client's parser: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` whose labels include ``labels`` (None: no such sample)."""
    hits = [v for (n, lab), v in samples(text).items() if n == name and set(labels.items()) <= lab]
    assert len(hits) <= 1, f"{name}{labels} matches {len(hits)} samples"
    return hits[0] if hits else None
