"""The relay as the tests run it: a real ``cri-resmgr relay`` subprocess in front of the test containerd."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from cri_resmgr.collectors.cgroup import detect_layout
from cri_resmgr.relay.control import ControlClient

from ..helpers import CGROUP_ROOT, _merge, stop_process


class RelayProcess:
    def __init__(self, tmp: Path, runtime_socket: Path, config: dict | None = None, name: str = "relay",
                 src: Path | None = None):
        """``src``: run the relay from another source tree (a ``git archive`` of an older commit: the benchmark
        sets two versions side by side) instead of the one installed in the venv."""
        self.tmp = Path(tmp)
        self.src = Path(src).resolve() if src is not None else None
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.socket = self.tmp / f"{name}.sock"
        self.control = self.tmp / "run" / "relay-control.sock"
        self.config_path = self.tmp / f"{name}.yaml"
        self.log_path = self.tmp / f"{name}.log"
        base = {"run_dir": str(self.tmp / "run"), "state_dir": str(self.tmp / "state"), "log_level": "info",
                "relay": {"socket": str(self.socket), "runtime_socket": str(runtime_socket),
                          "reconcile_interval_seconds": 0.5, "runtime_timeout_seconds": 10}}
        self.config = _merge(base, config or {})
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True, timeout: float = 30) -> RelayProcess:
        with open(self.log_path, "ab") as log:  # the relay keeps its own descriptor
            self._offset = log.tell()  # log() shows this run only
            env = None
            if self.src is not None:  # sys.path (PYTHONPATH) comes before the venv's editable-install finder
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [str(self.src)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cri_resmgr.cli", "relay", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.src)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"relay exited with {self.proc.returncode}:\n{self.log()}")
            if "relay listening on" in self.log():
                return
            time.sleep(0.05)
        raise AssertionError(f"relay not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_offset", 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def client(self) -> ControlClient:
        return ControlClient(self.control)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        stop_process(self.proc, sig, timeout)
        return self.proc.returncode if self.proc else None


def container_pid(status_response) -> int:
    """containerd's verbose ContainerStatus info carries the init pid."""
    return int(json.loads(status_response.info["info"])["pid"])


def cpus_allowed_list(pid: int) -> str:
    # proc(5): /proc/<pid>/status "Cpus_allowed_list" is the task's affinity as a cpulist.
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for pid {pid}")


def cgroup_cpuset(cgroup_path: str) -> str:
    """The container's cpuset as the kernel holds it (v1 cpuset.cpus, v2 cpuset.cpus of the leaf)."""
    layout = detect_layout(CGROUP_ROOT)
    base = layout.cpuset if layout.version == 1 else layout.root
    return (base / cgroup_path.lstrip("/") / "cpuset.cpus").read_text().strip()


def listening(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def is_root() -> bool:
    return os.geteuid() == 0
