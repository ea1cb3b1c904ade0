"""`cri-resmgr demo` for real: its workloads appear as containers in the agent, use CPU within their quota, and
SIGINT (Ctrl-C) stops everything and removes the cgroups."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cri_resmgr.collectors.cgroup import detect_layout
from cri_resmgr.demo import DEMO_DIR, DemoCgroups

from .helpers import CGROUP_ROOT, can_make_cgroups, free_port, wait_for

pytestmark = pytest.mark.integration

NAMES = {"avx512-loop", "scalar-loop", "membw-hog"}


def _state(pid: int) -> str:
    """The process state letter from /proc/<pid>/stat (proc(5)); "Z" for a zombie."""
    return Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_demo_runs_workloads_and_ctrl_c_cleans_up(tmp_path):
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    import httpx

    port = free_port()
    with open(tmp_path / "demo.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "cri_resmgr.cli", "demo", "--listen", f"127.0.0.1:{port}",
                                 "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path / "run"),
                                 "--cpu-quota", "0.2"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    cgroups = DemoCgroups.for_layout(detect_layout(CGROUP_ROOT))
    try:
        def demo_containers():
            try:
                cs = httpx.get(url + "/api/v1/containers", timeout=2).json()
            except httpx.HTTPError:
                return None
            got = {c["name"]: c for c in cs if c["namespace"] == "demo"}
            return got if set(got) == NAMES and all(c["cpu_usage_seconds"] for c in got.values()) else None

        first = wait_for(demo_containers, timeout=60, what="the demo's workloads in /api/v1/containers")
        for name, c in first.items():
            assert c["pod"] == name and c["cgroup_path"] == f"/{DEMO_DIR}/{name}"
        for root in cgroups.roots:
            assert {p.name for p in (root / DEMO_DIR).iterdir() if p.is_dir()} == NAMES, root
        pids = set()
        for root in cgroups.roots:
            for n in NAMES:
                pids |= {int(x) for x in (root / DEMO_DIR / n / "cgroup.procs").read_text().split()}
        assert len(pids) >= 3
        t_first = max(c["last_seen"] for c in first.values())
        later = wait_for(lambda: (d := demo_containers()) and min(c["last_seen"] for c in d.values()) > t_first + 2
                         and d, timeout=30, what="a later scan of the cgroups")
        for name in NAMES:
            used = later[name]["cpu_usage_seconds"] - first[name]["cpu_usage_seconds"]
            elapsed = later[name]["last_seen"] - first[name]["last_seen"]
            assert used > 0, name  # it runs
            assert used <= 0.2 * elapsed + 0.15, (name, used, elapsed)  # and stays within its CFS quota
        text = httpx.get(url + "/metrics", timeout=5).text
        assert 'cri_resmgr_container_cpu_usage_seconds_total{container="avx512-loop"' in text
        out = (tmp_path / "demo.log").read_text()
        if shutil.which("gcc") and "avx512f" in Path("/proc/cpuinfo").read_text():
            assert "compiled with" in out and "-mavx512f" in out
        assert f"http://127.0.0.1:{port}/ui/" in out

        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, (tmp_path / "demo.log").read_text()
    finally:
        if proc.poll() is None:  # a failed assertion above: still stop the demo the way a user would
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "demo", "--clean"], timeout=60)
    out = (tmp_path / "demo.log").read_text()
    assert "workloads stopped, cgroups removed" in out, out
    for root in cgroups.roots:
        assert not (root / DEMO_DIR).exists(), root
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", pid


def test_clean_removes_what_a_killed_demo_left(tmp_path):
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    cgroups = DemoCgroups.for_layout(detect_layout(CGROUP_ROOT))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cri_resmgr.cli", "demo", "--listen", f"127.0.0.1:{port}",
                             "--state-dir", str(tmp_path / "state"), "--run-dir", str(tmp_path / "run"),
                             "--cpu-quota", "0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        top = cgroups.roots[0] / DEMO_DIR
        wait_for(lambda: all((top / n / "cgroup.procs").exists() and (top / n / "cgroup.procs").read_text().strip()
                             for n in NAMES), timeout=60, what="demo workloads started")
    finally:
        proc.kill()  # SIGKILL: no clean-up possible
        proc.wait()
    pids = {int(x) for n in NAMES for x in (top / n / "cgroup.procs").read_text().split()}
    again = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "demo", "--listen", f"127.0.0.1:{free_port()}"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "demo --clean" in again.stderr
    r = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "demo", "--clean"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "killed 3 task(s)" in r.stdout, r.stdout + r.stderr
    for root in cgroups.roots:
        assert not (root / DEMO_DIR).exists()
    wait_for(lambda: all(not os.path.exists(f"/proc/{p}") or _state(p) == "Z" for p in pids), timeout=10,
             what="leftover workloads gone")
