"""``cri-resmgr rebalance --calibrate`` on this machine: a real memory-bandwidth hog beside a real memory-bound
probe on another core, against the probe alone; the report compares the model's predicted slowdown with the
measured one. The numbers depend on the machine (and on its load), so the test checks that they were measured
and that the report is consistent with them, not that the model is right: the run's own figures are in the
report (docs/rebalancer.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="calibration needs two CPUs")


def test_workers_stream_memory_pinned_to_their_cpu():
    cpu = max(os.sched_getaffinity(0))
    for role in ("probe", "hog"):
        out = subprocess.run([sys.executable, "-m", "cri_resmgr.rebalancer.calibrate", role, str(cpu), "0.2", "32"],
                             capture_output=True, text=True, timeout=60, check=True)
        r = json.loads(out.stdout)
        assert r["role"] == role and r["cpu"] == cpu and r["cpus_allowed"] == [cpu]
        assert r["passes"] >= 1 and r["bytes_per_second"] > 1e8  # at least 100 MB/s through memory


def test_calibrate_measures_hog_beside_probe_and_reports_the_prediction():
    out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", "--seconds", "0.7",
                          "--array-mib", "64"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    a, b = r["cpus"]
    assert a != b
    for k in ("probe_alone_bytes_per_second", "hog_alone_bytes_per_second", "capacity_bytes_per_second",
              "probe_beside_hog_bytes_per_second", "hog_beside_probe_bytes_per_second"):
        assert r[k] > 1e8, (k, r)
    assert r["measured_slowdown"] == pytest.approx(
        r["probe_alone_bytes_per_second"] / r["probe_beside_hog_bytes_per_second"] - 1)
    demand = r["probe_alone_bytes_per_second"] + r["hog_alone_bytes_per_second"]
    assert r["predicted_slowdown"] == pytest.approx(max(0.0, demand / r["capacity_bytes_per_second"] - 1))
    assert r["error"] == pytest.approx(r["predicted_slowdown"] - r["measured_slowdown"])
    assert r["within_tolerance"] == (abs(r["error"]) <= 0.25 * max(abs(r["measured_slowdown"]), 1e-9))


def test_calibrate_rejects_bad_arguments_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", "--seconds", "0"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--seconds" in out.stderr
