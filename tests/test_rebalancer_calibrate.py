"""``cri-resmgr rebalance --calibrate`` on this machine: a real memory-bandwidth hog beside a real memory-bound
probe on another core, against the probe alone; the report compares the model's predicted slowdown with the
measured one. The numbers depend on the machine (and on its load), so the run test checks that they were measured
and that the report is consistent with them — or that a run without enough clean rounds says so and prints no
figure — not that the model is right: the runs' own figures are in docs/rebalancer.md. The arithmetic of the
report (what is predicted from what, which rounds count, the estimators and their intervals) is checked on fixed
rounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from cri_resmgr.rebalancer import bandwidth_curve as bwc
from cri_resmgr.rebalancer.calibrate import (
    MAX_DISTURBANCE,
    MIN_CLEAN_ROUNDS,
    CalibrationError,
    CpuTicks,
    Disturbance,
    Round,
    SliceResult,
    disturbance,
    median_interval,
    parse_cpu_ticks,
    summarise,
    trimmed_mean,
)

GB = 1e9

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="calibration needs two CPUs")


def _worker(role: str, cpu: int, mib: int, kind: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cri_resmgr.rebalancer.calibrate", role, str(cpu), str(mib), kind],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


@needs_two_cpus
@pytest.mark.parametrize(("role", "kind"), [("probe", "read"), ("hog", "read"), ("hog", "copy")])
def test_workers_stream_memory_pinned_to_their_cpu_for_the_slices_they_are_sent(role, kind):
    cpu = max(os.sched_getaffinity(0))
    p = _worker(role, cpu, 32, kind)
    try:
        assert p.stdout.readline().strip() == "ready"
        for _ in range(2):
            t = time.time() + 0.05
            p.stdin.write(f"{t} {t + 0.2}\n")
            p.stdin.flush()
            r = json.loads(p.stdout.readline())
            assert r["role"] == role and r["cpu"] == cpu and r["cpus_allowed"] == [cpu]
            assert 0.15 < r["wall_seconds"] < 1.0 and 0 < r["cpu_seconds"] <= r["wall_seconds"] + 0.01
            assert t <= r["start"] < r["end"] and r["end"] - r["start"] == pytest.approx(r["wall_seconds"], abs=0.01)
            assert r["bytes"] / r["cpu_seconds"] > 1e8  # at least 100 MB/s through memory
    finally:
        p.stdin.close()
        assert p.wait(timeout=30) == 0


def test_a_probe_with_a_copy_kernel_is_refused():
    out = subprocess.run([sys.executable, "-m", "cri_resmgr.rebalancer.calibrate", "probe", "0", "16", "copy"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "unknown kernel" in out.stderr


CALM = Disturbance()


def _round(pa, ha, pk, pb, hb, d=CALM):
    return Round(pa * GB, ha * GB, pk * GB, pb * GB, hb * GB, d)


BUSY = Disturbance(loader_share_lost=0.5)  # a hog descheduled half its slice


def test_summary_predicts_from_the_alone_bandwidths_and_the_peak_only():
    rounds = [_round(14, 16, 27, 12, 15), _round(15, 17, 26, 11, 14), _round(13, 15, 28, 12, 16)]
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3)
    bp, bh, cap = 14 * GB, 16 * GB, 27 * GB  # medians over rounds
    assert (c.probe_alone_bytes_per_second, c.hog_alone_bytes_per_second, c.capacity_bytes_per_second) == (bp, bh, cap)
    expected = float(bwc.slowdown_factor((bp + bh) / cap) / bwc.slowdown_factor(bp / cap)) - 1
    assert c.predicted_slowdown == pytest.approx(expected)
    ratios = [14 / 12 - 1, 15 / 11 - 1, 13 / 12 - 1]
    assert c.measured_slowdown == pytest.approx(np.median(ratios))
    assert c.measured_slowdown_interval == (min(ratios), max(ratios))  # three values: the whole range
    assert c.error == pytest.approx(c.predicted_slowdown - c.measured_slowdown)
    assert c.within_tolerance == (abs(c.error) <= 0.25 * c.measured_slowdown)
    assert c.verdict == ("within ±25%" if c.within_tolerance else "outside ±25%") and c.conclusive
    assert c.hinge_predicted_slowdown == pytest.approx(max(0.0, (bp + bh) / cap - 1))
    assert c.memory_bandwidth_cost_per_second == pytest.approx(4.0 * float(bwc.QUEUEING((bp + bh) / cap)))
    # Two hogs offering 2 × 16 GB/s delivered 27: the curve says a 27 GB/s domain offered that delivers 0.83 of it.
    assert c.peak_offered_load == pytest.approx(32 / 27)
    assert c.model_peak_utilisation == pytest.approx(float(bwc.achieved(32 / 27)), abs=0.01)
    assert 0.8 < c.model_peak_utilisation < 0.87
    # What is predicted does not enter the prediction: other beside-hog figures, same prediction.
    other = summarise((0, 1), [0, 1], 64, [_round(14, 16, 27, 7, 9), _round(15, 17, 26, 7, 9),
                                           _round(13, 15, 28, 7, 9)], 0.2, weight=4.0, min_clean=3)
    assert other.predicted_slowdown == c.predicted_slowdown and other.measured_slowdown != c.measured_slowdown


def test_disturbed_rounds_are_left_out_of_the_measurement_and_of_the_prediction():
    good = [_round(14, 16, 27, 12, 15), _round(15, 17, 26, 11, 14), _round(13, 15, 28, 12, 16)]
    # Disturbed rounds with other figures for every phase: none of them may move any figure.
    bad = [_round(9, 30, 20, 14, 6, BUSY), _round(9, 30, 20, 14, 6, Disturbance(foreign_share=0.3)),
           _round(9, 30, 20, 14, 6, Disturbance(hog_covered_probe=False)),
           _round(9, 30, 20, 14, 6, Disturbance(loader_share_lost=MAX_DISTURBANCE + 0.01))]
    c = summarise((0, 1), [0, 1], 64, bad[:2] + good + bad[2:], 0.2, weight=4.0, min_clean=3)
    assert c.clean_rounds == [2, 3, 4] and len(c.rounds) == 7
    keep = {"rounds": None, "clean_rounds": None}
    assert c.as_dict() | keep == summarise((0, 1), [0, 1], 64, good, 0.2, weight=4.0, min_clean=3).as_dict() | keep
    # At the threshold a round still counts; steal alone does not disturb (it is outside the workers' CPU time).
    edge = _round(14, 16, 27, 12, 15, Disturbance(loader_share_lost=MAX_DISTURBANCE, steal_share=0.5))
    assert edge.clean


def test_without_enough_clean_rounds_there_is_no_measured_figure():
    good = [_round(14, 16, 27, 12, 15)] * (MIN_CLEAN_ROUNDS - 1)
    c = summarise((0, 1), [0, 1], 64, good + [_round(9, 30, 20, 14, 6, BUSY)] * 40, 0.2, weight=4.0)
    assert not c.conclusive and c.verdict == f"not enough clean rounds: {MIN_CLEAN_ROUNDS - 1} of " \
                                             f"{MIN_CLEAN_ROUNDS + 39} (need {MIN_CLEAN_ROUNDS})"
    assert c.measured_slowdown is None and c.predicted_slowdown is None and c.within_tolerance is None
    assert len(c.rounds) == MIN_CLEAN_ROUNDS + 39  # every round is still in the report
    # One more clean round and it measures (no fallback to disturbed rounds either way).
    assert summarise((0, 1), [0, 1], 64, good * 2, 0.2, weight=4.0).conclusive


def test_summary_below_capacity_predicts_a_slowdown_where_the_hinge_predicted_none():
    c = summarise((0, 1), [0, 1], 64, [_round(10, 10, 40, 9, 9)] * 3, 0.2, weight=4.0, min_clean=3)
    assert c.hinge_predicted_slowdown == 0.0
    assert 0.0 < c.predicted_slowdown < 0.2
    assert c.within_tolerance == (abs(c.predicted_slowdown - 1 / 9) <= 0.25 / 9)


def test_summary_without_a_measured_phase_is_an_error():
    with pytest.raises(CalibrationError):
        summarise((0, 1), [0, 1], 64, [], 0.2, weight=4.0)
    with pytest.raises(CalibrationError):
        summarise((0, 1), [0, 1], 64, [_round(10, 0, 40, 9, 9)], 0.2, weight=4.0, min_clean=1)


def test_median_interval_is_the_sign_test_interval():
    xs = list(range(1, 21))  # n = 20: x(6) and x(15) (binomial tables: 2 P(B ≤ 5) = 0.041 ≤ 0.05 < 0.115)
    assert median_interval(xs[::-1]) == (6, 15)
    assert median_interval(list(range(1, 11))) == (2, 9)  # n = 10: 2 P(B ≤ 1) = 0.021, 2 P(B ≤ 2) = 0.109
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few for 95 %: the whole range
    assert median_interval([5.0]) == (5.0, 5.0)
    with pytest.raises(ValueError):
        median_interval([])


def test_median_interval_covers_the_true_median_at_least_as_often_as_it_says():
    rng = np.random.default_rng(7)
    # A skewed distribution with a heavy right tail, like the rounds' ratios: lognormal, median exp(0) = 1.
    hits = sum(lo <= 1.0 <= hi for lo, hi in (median_interval(rng.lognormal(0, 0.8, 30)) for _ in range(2000)))
    assert 0.95 <= hits / 2000 <= 0.995


def test_trimmed_mean_drops_the_tails():
    assert trimmed_mean([0, 1, 2, 3, 100]) == pytest.approx(2.0)  # 20 % of 5: one value off each end
    assert trimmed_mean([1.0, 2.0]) == pytest.approx(1.5)


STAT = """cpu  865840 914471 584212 1893694 55715 0 26085 184409 0 0
cpu0 349968 432577 285564 1079032 21215 0 1515 90663 0 0
cpu1 515872 481893 298648 814661 34499 3 24569 93746 7 1
cpu2 1 2 3
cpuX 1 2 3 4 5 6 7 8 9 10
intr 123 0 0
"""


def test_parse_cpu_ticks_reads_busy_and_steal_per_cpu():
    t = parse_cpu_ticks(STAT)
    assert set(t) == {0, 1}  # the total line, a short line and a malformed one are skipped
    assert t[0] == CpuTicks(busy=349968 + 432577 + 285564 + 0 + 1515, steal=90663)
    assert t[1] == CpuTicks(busy=515872 + 481893 + 298648 + 3 + 24569, steal=93746)  # guest is inside user
    assert parse_cpu_ticks("") == {}


def _slice(cpu: int, cpu_seconds: float, wall: float = 0.2) -> SliceResult:
    return SliceResult("hog", cpu, 10**9, cpu_seconds, wall, [cpu], 0.0, wall)


def test_disturbance_counts_loaders_and_idle_cpus_not_a_workers_own_lost_time():
    before = {0: CpuTicks(100, 10), 1: CpuTicks(200, 20)}
    # The probe on CPU 0 lost half its slice (its bandwidth is over its own CPU time: no disturbance); CPU 1,
    # which should have been idle, ran 4 ticks of something else in 0.2 s at 100 Hz: 20 %.
    d = disturbance([_slice(0, 0.1)], [], before, {0: CpuTicks(110, 15), 1: CpuTicks(204, 20)}, 0.2, 100.0, [1])
    assert d == Disturbance(loader_share_lost=0.0, foreign_share=pytest.approx(0.2), steal_share=pytest.approx(0.25))
    assert d.share == pytest.approx(0.2)
    # A loader (the hog beside the probe) that ran 70 % of its slice is a disturbance of 30 %.
    d = disturbance([_slice(1, 0.14), _slice(0, 0.2)], [0], before, before, 0.2, 100.0, [])
    assert d.loader_share_lost == pytest.approx(0.3) and d.foreign_share == 0.0
    # No /proc/stat: only the loaders are checked.
    assert disturbance([_slice(1, 0.2)], [0], {}, {}, 0.2, 100.0, [0]) == Disturbance()
    worst = Disturbance.worst([Disturbance(0.05, 0.0, 0.1), Disturbance(0.0, 0.2, 0.0, hog_covered_probe=False)])
    assert worst == Disturbance(0.05, 0.2, 0.1, False) and worst.share == 1.0


@needs_two_cpus
def test_calibrate_measures_hog_beside_probe_and_reports_the_prediction_or_says_it_could_not():
    out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", "--seconds", "3",
                          "--array-mib", "64"], capture_output=True, text=True, timeout=300, check=False)
    r = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    a, b = r["cpus"]
    assert a != b and r["peak_cpus"][:2] == [a, b] and r["hog"] == "read"
    wanted = round(3 / r["slice_seconds"])
    clean = [i for i, x in enumerate(r["rounds"]) if max(x["disturbance"]["loader_share_lost"],
                                                         x["disturbance"]["foreign_share"]) <= MAX_DISTURBANCE
             and x["disturbance"]["hog_covered_probe"]]
    assert r["clean_rounds"] == clean
    # It stops at the wanted number of clean rounds, or at four times as many rounds.
    assert len(clean) == wanted or (len(clean) < wanted and len(r["rounds"]) == 4 * wanted)
    if len(clean) < MIN_CLEAN_ROUNDS:
        assert out.returncode == 1 and "not enough clean rounds" in out.stderr
        assert r["measured_slowdown"] is None and r["predicted_slowdown"] is None
        return
    assert out.returncode == 0, out.stderr
    used = [r["rounds"][i] for i in clean]
    for k in ("probe_alone_bytes_per_second", "hog_alone_bytes_per_second", "capacity_bytes_per_second",
              "probe_beside_hog_bytes_per_second", "hog_beside_probe_bytes_per_second"):
        assert r[k] > 1e8, (k, r)
        per_round = k.replace("capacity", "peak")
        assert r[k] == pytest.approx(np.median([x[per_round] for x in used]))
    slow = [x["probe_alone_bytes_per_second"] / x["probe_beside_hog_bytes_per_second"] - 1 for x in used]
    assert r["measured_slowdown"] == pytest.approx(np.median(slow))
    lo, hi = r["measured_slowdown_interval"]
    assert lo <= r["measured_slowdown"] <= hi
    bp, bh, cap = r["probe_alone_bytes_per_second"], r["hog_alone_bytes_per_second"], r["capacity_bytes_per_second"]
    assert r["predicted_slowdown"] == pytest.approx(
        float(bwc.slowdown_factor((bp + bh) / cap) / bwc.slowdown_factor(bp / cap)) - 1)
    assert r["error"] == pytest.approx(r["predicted_slowdown"] - r["measured_slowdown"])
    assert r["within_tolerance"] == (abs(r["error"]) <= 0.25 * abs(r["measured_slowdown"]))


def test_calibrate_rejects_bad_arguments_with_exit_2():
    for args in (["--seconds", "0"], ["--seconds", "2"], ["--hog", "spin"]):
        out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", *args],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and args[0] in out.stderr, (args, out.stderr)
