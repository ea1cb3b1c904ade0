"""The NRI plugin as the tests and the bench run it: a real ``cri-resmgr nri`` subprocess registered with a
private containerd 1.7 (tests/integration/containerd.py with ``bin_dir`` and ``nri_socket``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from cri_resmgr.relay.control import ControlClient

from ..containerd import BUSYBOX, Containerd
from ..helpers import _merge, stop_process
from .containerd17 import FetchError, fetch


def start_containerd17(base: Path | None = None) -> Containerd:
    """A started private containerd 1.7 with NRI on ``base/nri.sock`` and the test images imported.
    Raises FetchError (with the reason) when it cannot be had here."""
    if os.geteuid() != 0:
        raise FetchError("needs root to run containerd")
    missing = [b for b in ("runc",) if shutil.which(b) is None] + ([str(BUSYBOX)] if not BUSYBOX.exists() else [])
    if missing:
        raise FetchError(f"missing {', '.join(missing)} (apt-get install runc busybox-static)")
    f = fetch()
    base = base or Path(tempfile.mkdtemp(prefix="crirm-containerd17-"))
    return Containerd(base, bin_dir=f.bin_dir, nri_socket=base / "nri.sock").up()


class NriPluginProcess:
    def __init__(self, tmp: Path, nri_socket: Path, config: dict | None = None, name: str = "nri"):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.control = self.tmp / "run" / "relay-control.sock"
        self.config_path = self.tmp / f"{name}.yaml"
        self.log_path = self.tmp / f"{name}.log"
        base = {"run_dir": str(self.tmp / "run"), "state_dir": str(self.tmp / "state"), "log_level": "info",
                "relay": {"reconcile_interval_seconds": 1, "runtime_timeout_seconds": 5},
                "nri": {"socket": str(nri_socket), "reconnect_max_seconds": 1}}
        self.config = _merge(base, config or {})
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.proc: subprocess.Popen | None = None
        self._offset = 0

    def start(self, wait: bool = True, timeout: float = 30) -> NriPluginProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child, closed in stop()
        self._offset = self._log.tell()  # log() shows this run only
        self.proc = subprocess.Popen([sys.executable, "-m", "cri_resmgr.cli", "nri", "--config", str(self.config_path)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_for("synchronised", timeout)
        return self

    def wait_for(self, text: str, timeout: float = 30, count: int = 1) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"nri plugin exited with {self.proc.returncode}:\n{self.log()}")
            if self.log().count(text) >= count:
                return
            time.sleep(0.05)
        raise AssertionError(f"nri plugin log has no {text!r} x{count} after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def client(self) -> ControlClient:
        return ControlClient(self.control, timeout=10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        stop_process(self.proc, sig, timeout)
        if self.proc is not None:
            self._log.close()
        return self.proc.returncode if self.proc else None
