"""``cri-resmgr rebalance --calibrate`` on this machine: a real memory-bandwidth hog beside a real memory-bound
probe on another core, against the probe alone; the report compares the model's predicted slowdown with the
measured one. The numbers depend on the machine (and on its load), so the run test checks that they were measured
and that the report is consistent with them, not that the model is right: the run's own figures are in the
report (docs/rebalancer.md). The arithmetic of the report (what is predicted from what) is checked on fixed rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from cri_resmgr.rebalancer import bandwidth_curve as bwc
from cri_resmgr.rebalancer.calibrate import MIN_CPU_SHARE, CalibrationError, Round, summarise

GB = 1e9

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="calibration needs two CPUs")


def _worker(role: str, cpu: int, mib: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cri_resmgr.rebalancer.calibrate", role, str(cpu), str(mib)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@needs_two_cpus
def test_workers_stream_memory_pinned_to_their_cpu_for_the_slices_they_are_sent():
    cpu = max(os.sched_getaffinity(0))
    for role in ("probe", "hog"):
        p = _worker(role, cpu, 32)
        try:
            assert p.stdout.readline().strip() == "ready"
            for _ in range(2):
                t = time.time() + 0.05
                p.stdin.write(f"{t} {t + 0.2}\n")
                p.stdin.flush()
                r = json.loads(p.stdout.readline())
                assert r["role"] == role and r["cpu"] == cpu and r["cpus_allowed"] == [cpu]
                assert 0.15 < r["wall_seconds"] < 1.0 and 0 < r["cpu_seconds"] <= r["wall_seconds"] + 0.01
                assert r["bytes"] / r["cpu_seconds"] > 1e8  # at least 100 MB/s through memory
        finally:
            p.stdin.close()
            assert p.wait(timeout=30) == 0


def _round(pa, ha, pk, pb, hb, share=1.0):
    return Round(pa * GB, ha * GB, pk * GB, pb * GB, hb * GB, share)


def test_summary_predicts_from_the_alone_bandwidths_and_the_peak_only():
    rounds = [_round(14, 16, 27, 12, 15), _round(15, 17, 26, 11, 14), _round(13, 15, 28, 12, 16)]
    c = summarise((0, 1), [0, 1], 64, rounds, 0.5, weight=4.0)
    bp, bh, cap = 14 * GB, 16 * GB, 27 * GB  # medians over rounds
    assert (c.probe_alone_bytes_per_second, c.hog_alone_bytes_per_second, c.capacity_bytes_per_second) == (bp, bh, cap)
    expected = float(bwc.slowdown_factor((bp + bh) / cap) / bwc.slowdown_factor(bp / cap)) - 1
    assert c.predicted_slowdown == pytest.approx(expected)
    assert c.measured_slowdown == pytest.approx(np.median([14 / 12 - 1, 15 / 11 - 1, 13 / 12 - 1]))
    assert c.error == pytest.approx(c.predicted_slowdown - c.measured_slowdown)
    assert c.within_tolerance == (abs(c.error) <= 0.25 * c.measured_slowdown)
    assert c.hinge_predicted_slowdown == pytest.approx(max(0.0, (bp + bh) / cap - 1))
    assert c.memory_bandwidth_cost_per_second == pytest.approx(4.0 * float(bwc.QUEUEING((bp + bh) / cap)))
    # What is predicted does not enter the prediction: other beside-hog figures, same prediction.
    other = summarise((0, 1), [0, 1], 64, [_round(14, 16, 27, 7, 9), _round(15, 17, 26, 7, 9),
                                           _round(13, 15, 28, 7, 9)], 0.5, weight=4.0)
    assert other.predicted_slowdown == c.predicted_slowdown and other.measured_slowdown != c.measured_slowdown


def test_rounds_where_a_worker_was_kept_off_its_cpu_are_left_out():
    good = [_round(14, 16, 27, 12, 15), _round(15, 17, 26, 11, 14), _round(13, 15, 28, 12, 16)]
    bad = [_round(14, 16, 20, 14, 6, share=0.5)] * 4  # a hog descheduled half the slice: no slowdown seen
    c = summarise((0, 1), [0, 1], 64, good + bad, 0.5, weight=4.0)
    assert c.rounds_used == 3 and len(c.rounds) == 7
    assert c.as_dict() | {"rounds": None, "rounds_used": None} == summarise(
        (0, 1), [0, 1], 64, good, 0.5, weight=4.0).as_dict() | {"rounds": None, "rounds_used": None}
    # When no round is clean, all are used (and the report says so).
    assert summarise((0, 1), [0, 1], 64, bad, 0.5, weight=4.0).rounds_used == 4


def test_summary_below_capacity_predicts_a_slowdown_where_the_hinge_predicted_none():
    c = summarise((0, 1), [0, 1], 64, [_round(10, 10, 40, 9, 9)] * 3, 0.5, weight=4.0)
    assert c.hinge_predicted_slowdown == 0.0
    assert 0.0 < c.predicted_slowdown < 0.2
    assert c.within_tolerance == (abs(c.predicted_slowdown - 1 / 9) <= 0.25 / 9)


def test_summary_without_a_measured_phase_is_an_error():
    with pytest.raises(CalibrationError):
        summarise((0, 1), [0, 1], 64, [], 0.5, weight=4.0)
    with pytest.raises(CalibrationError):
        summarise((0, 1), [0, 1], 64, [_round(10, 0, 40, 9, 9)], 0.5, weight=4.0)


@needs_two_cpus
def test_calibrate_measures_hog_beside_probe_and_reports_the_prediction():
    out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", "--seconds", "0.7",
                          "--array-mib", "64"], capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    a, b = r["cpus"]
    assert a != b and r["peak_cpus"][:2] == [a, b]
    assert len(r["rounds"]) == 3
    used = [x for x in r["rounds"] if x["min_cpu_share"] >= MIN_CPU_SHARE] or r["rounds"]
    assert r["rounds_used"] == len(used) and all(0 < x["min_cpu_share"] <= 1.05 for x in r["rounds"])
    for k in ("probe_alone_bytes_per_second", "hog_alone_bytes_per_second", "capacity_bytes_per_second",
              "probe_beside_hog_bytes_per_second", "hog_beside_probe_bytes_per_second"):
        assert r[k] > 1e8, (k, r)
        per_round = k.replace("capacity", "peak")
        assert r[k] == pytest.approx(np.median([x[per_round] for x in used]))
    slow = [x["probe_alone_bytes_per_second"] / x["probe_beside_hog_bytes_per_second"] - 1 for x in used]
    assert r["measured_slowdown"] == pytest.approx(np.median(slow))
    bp, bh, cap = r["probe_alone_bytes_per_second"], r["hog_alone_bytes_per_second"], r["capacity_bytes_per_second"]
    assert r["predicted_slowdown"] == pytest.approx(
        float(bwc.slowdown_factor((bp + bh) / cap) / bwc.slowdown_factor(bp / cap)) - 1)
    assert r["error"] == pytest.approx(r["predicted_slowdown"] - r["measured_slowdown"])
    assert r["within_tolerance"] == (abs(r["error"]) <= 0.25 * max(abs(r["measured_slowdown"]), 1e-9))


def test_calibrate_rejects_bad_arguments_with_exit_2():
    out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", "--seconds", "0"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--seconds" in out.stderr
