"""Start the real agent as a subprocess, and put real processes into real cgroups."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import yaml

from cri_resmgr.collectors.cgroup import detect_layout
from cri_resmgr.demo import remove_cgroup_dirs

CGROUP_ROOT = Path("/sys/fs/cgroup")


def stop_process(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
    """Signal a child and wait for it; kill it if it does not exit within ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AgentProcess:
    def __init__(self, tmp: Path, config: dict | None = None, name: str = "agent"):
        self.tmp = tmp
        self.port = free_port()
        self.config_path = tmp / f"{name}.yaml"
        base = {"listen": f"127.0.0.1:{self.port}", "state_dir": str(tmp / "state"), "run_dir": str(tmp / "run"),
                "collectors": {"cgroup": {"interval_seconds": 0.5}, "cpu": {"interval_seconds": 0.5}},
                "store": {"checkpoint_interval_seconds": 1}}
        self.config = _merge(base, config or {})
        self.write_config(self.config)
        self.log_path = tmp / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self, cfg: dict) -> None:
        self.config_path.write_text(yaml.safe_dump(cfg))

    def start(self, wait: bool = True) -> AgentProcess:
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([sys.executable, "-m", "cri_resmgr.cli", "run", "--config",
                                          str(self.config_path)], stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"agent not ready in {timeout}s:\n{self.log_path.read_text()}")

    def get(self, path: str, **params):
        r = httpx.get(self.url + path, params=params, timeout=10)
        r.raise_for_status()
        return r.json() if "json" in r.headers.get("content-type", "") else r.text

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        stop_process(self.proc, sig, timeout)
        return self.proc.returncode if self.proc else 0


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def wait_for(fn, timeout: float = 20, interval: float = 0.2, what: str = "condition"):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last value {last!r}")


class RealCgroup:
    """A Kubernetes-shaped container cgroup (cgroupfs driver) on this machine's real hierarchy.

    On hybrid hosts (v1 controllers plus a v2 tree at ``unified``) the cgroup is also made in the v2 tree
    and tasks join it there too, as runc does: that is the cgroup ``bpf_get_current_cgroup_id()`` names.
    ``unified=False`` keeps to the v1 controllers.
    """

    def __init__(self, qos: str = "burstable", unified: bool = True):
        self.pod_uid = str(uuid.uuid4())
        self.container_id = uuid.uuid4().hex + uuid.uuid4().hex
        self.rel = f"kubepods/{qos}/pod{self.pod_uid}/{self.container_id}"
        self.layout = detect_layout(CGROUP_ROOT)
        self.unified = unified
        self.created: list[Path] = []

    def _controller_roots(self) -> list[Path]:
        if self.layout.version == 2:
            return [self.layout.root]
        roots = []
        for p in (self.layout.cpuacct, self.layout.cpu, self.layout.memory, self.layout.cpuset):
            if p is not None and p.resolve() not in [r.resolve() for r in roots]:
                roots.append(p)
        if self.unified and self.layout.unified is not None:
            roots.append(self.layout.unified)
        return roots

    def create(self) -> RealCgroup:
        for root in self._controller_roots():
            d = root
            for part in self.rel.split("/"):
                parent, d = d, d / part
                if not d.exists():
                    d.mkdir()
                    self.created.append(d)
                    if (d / "cpuset.cpus").exists() and self.layout.version == 1:
                        # v1 cpusets start empty; a task cannot join until cpus and mems are set.
                        (d / "cpuset.cpus").write_text((parent / "cpuset.cpus").read_text())
                        (d / "cpuset.mems").write_text((parent / "cpuset.mems").read_text())
        return self

    def add(self, pid: int) -> None:
        for root in self._controller_roots():
            (root / self.rel / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        remove_cgroup_dirs(reversed(self.created))


def busy_process() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def can_make_cgroups() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create cgroups"
    if detect_layout(CGROUP_ROOT) is None:
        return "no cgroup hierarchy with CPU accounting at /sys/fs/cgroup"
    return None
