"""A runtime that hangs one call: a runc wrapper for containerd's runc shim (``BinaryName``).

The runc shim runs its ``BinaryName`` as it would run runc (go-runc: global options, then the command, its
options, and the container id last). The wrapper execs the real runc at once, except for the first ``<op>``
(``create``, ``start``, ``update``, ...) of a container whose OCI spec carries the environment entry
``CRIRM_TEST_HANG=<op>[,<op>...]`` (CRI puts a container's ``envs`` into the spec's ``process.env``): that one
blocks until the test releases it (or ``max_seconds`` pass), then execs runc. So exactly one runtime operation
of one container hangs inside containerd, while every other call goes on.

The spec is read from the task's bundle: ``create`` names it (``--bundle``), the other commands find it at
``<containerd state>/io.containerd.runtime.v2.task/k8s.io/<id>`` (:meth:`Containerd.task_bundle`).

Files in ``ctl_dir`` (the wrapper's only state): ``hung-<op>-<id>`` while it blocks, ``release-<op>-<id>``
written by the test to let it go, ``done-<op>-<id>`` once it has been let go (so the next ``<op>`` of that
container runs at once).
"""

from __future__ import annotations

import time
from pathlib import Path

MARK = "CRIRM_TEST_HANG"

# Run by the shim for every runc call: keep it small and quick (python3 -IS: isolated, no site; one flag
# argument, since the kernel passes everything after the interpreter's path as one).
WRAPPER = r'''#!{python} -IS
import json, os, sys, time
RUNC, CTL, STATE, MARK, MAX = {runc!r}, {ctl!r}, {state!r}, {mark!r}, {max_seconds!r}
# go-runc's global options that take a value (runc --help: --root, --log, --log-format, --criu, --rootless)
VALUED = {{"--root", "--log", "--log-format", "--criu", "--rootless"}}


def hang_op(args):
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 1 + (args[i] in VALUED)
    if i >= len(args) - 1:
        return None
    op, rest, cid = args[i], args[i + 1:], args[-1]
    bundle = os.path.join(STATE, "io.containerd.runtime.v2.task", "k8s.io", cid)
    for j, a in enumerate(rest[:-1]):
        if a in ("--bundle", "-b"):
            bundle = rest[j + 1]
        elif a.startswith("--bundle="):
            bundle = a.split("=", 1)[1]
    try:
        with open(os.path.join(bundle, "config.json")) as f:
            env = json.load(f).get("process", {{}}).get("env", [])
    except (OSError, ValueError):
        return None
    for e in env:
        if e.startswith(MARK + "=") and op in e.split("=", 1)[1].split(","):
            return op + "-" + cid
    return None


def main():
    args = sys.argv[1:]
    key = hang_op(args)
    if key is not None and not os.path.exists(os.path.join(CTL, "done-" + key)):
        hung = os.path.join(CTL, "hung-" + key)
        with open(hung, "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + MAX
        release = os.path.join(CTL, "release-" + key)
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(os.path.join(CTL, "done-" + key), "w"):
            pass
        os.unlink(hung)
    os.execv(RUNC, [RUNC] + args)


main()
'''


class RuncHang:
    """Installs the wrapper in ``ctl_dir`` and lets the test watch and release the hung operations."""

    def __init__(self, ctl_dir: Path, runc: str, containerd_state: Path, python: str = "/usr/bin/python3",
                 max_seconds: float = 60):
        self.ctl = Path(ctl_dir)
        self.ctl.mkdir(parents=True, exist_ok=True)
        self.binary = self.ctl / "runc-hang"
        self.binary.write_text(WRAPPER.format(python=python, runc=runc, ctl=str(self.ctl),
                                              state=str(containerd_state), mark=MARK, max_seconds=max_seconds))
        self.binary.chmod(0o755)

    @staticmethod
    def env(*ops: str) -> dict[str, str]:
        """The container env entry that marks its ``ops`` to hang (once each)."""
        return {MARK: ",".join(ops)}

    def hung(self, op: str, container_id: str) -> bool:
        return (self.ctl / f"hung-{op}-{container_id}").exists()

    def done(self, op: str, container_id: str) -> bool:
        return (self.ctl / f"done-{op}-{container_id}").exists()

    def wait_hung(self, op: str, container_id: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not self.hung(op, container_id):
            if time.monotonic() > deadline:
                raise AssertionError(f"runc {op} of {container_id[:12]} not hung within {timeout}s")
            time.sleep(0.02)

    def release(self, op: str, container_id: str) -> None:
        (self.ctl / f"release-{op}-{container_id}").touch()

    def release_all(self) -> None:
        for h in self.ctl.glob("hung-*"):
            (self.ctl / ("release-" + h.name[len("hung-"):])).touch()
