"""``cri-resmgr rebalance --calibrate`` on this machine: a real memory-bandwidth hog beside a real memory-bound
probe on another core, against the probe alone; the curve's capacity is fitted to the peak phase and its
predicted slowdowns at two other operating points (the full and the throttled hog) are compared with the
measured ones. The numbers depend on the machine (and on its load), so the run test checks that they were measured
and that the report is consistent with them — or that a run without enough clean rounds says so and prints no
figure — not that the model is right: the runs' own figures are in docs/rebalancer.md. The arithmetic of the
report (what is predicted from what, which rounds count, the estimators and their intervals) is checked on fixed
rounds."""

from __future__ import annotations

import json
import math
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
    fit_capacity,
    median_interval,
    parse_cpu_ticks,
    pool,
    predict,
    summarise,
    together,
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


def test_a_throttled_hog_streams_about_its_duty_of_the_time():
    cpu = max(os.sched_getaffinity(0))
    p = _worker("hog", cpu, 32, "read")
    try:
        assert p.stdout.readline().strip() == "ready"
        rates = {}
        for duty in (1.0, 0.5, 1.0, 0.5):
            t = time.time() + 0.05
            p.stdin.write(f"{t} {t + 0.2} {duty}\n")
            p.stdin.flush()
            r = json.loads(p.stdout.readline())
            assert r["duty"] == duty and r["cpu_seconds"] > 0.15  # it spins: its CPU stays busy
            rates.setdefault(duty, []).append(r["bytes"] / r["cpu_seconds"])
        # Half the time streaming: well under the full rate, well over nothing (the spin costs some time too).
        assert 0.2 < max(rates[0.5]) / min(rates[1.0]) < 0.75
    finally:
        p.stdin.close()
        assert p.wait(timeout=30) == 0


CALM = Disturbance()


def _round(pa, ha, pk, pb, hb, ht=None, pt=None, htb=None, h0=None, d=CALM):
    """GB/s: probe alone, hog alone, peak, probe beside hog, hog beside probe, the throttled hog's three (by
    default half the hog's load and a probe between alone and beside the full hog), and the peak's first hog
    alone (by default as the probe)."""
    ht = ha / 2 if ht is None else ht
    pt = (pa + pb) / 2 if pt is None else pt
    htb = ht if htb is None else htb
    h0 = pa if h0 is None else h0
    return Round(pa * GB, ha * GB, pk * GB, pb * GB, hb * GB, ht * GB, pt * GB, htb * GB, h0 * GB, d)


BUSY = Disturbance(loader_share_lost=0.5)  # a hog descheduled half its slice


def test_together_on_a_huge_capacity_delivers_what_the_streams_draw_alone_and_less_on_a_small_one():
    alone = [15 * GB, 16 * GB]
    total, q = together(alone, 1e6 * GB)
    assert total == pytest.approx(31 * GB, rel=1e-4) and q == pytest.approx(1.0, abs=1e-4)
    total, q = together(alone, 40 * GB)
    assert 20 * GB < total < 31 * GB and q > 1.1
    # One stream alone delivers what it draws alone, whatever the capacity (that is how its demand is defined).
    assert together([15 * GB], 20 * GB)[0] == pytest.approx(15 * GB)
    with pytest.raises(ValueError):
        together(alone, 16 * GB)


def test_fit_capacity_reproduces_the_delivered_total_and_less_loss_means_more_capacity():
    alone = [15 * GB, 16 * GB]
    for delivered in (30.9, 30.0, 27.0, 22.0):
        c = fit_capacity(alone, delivered * GB)
        assert c is not None and together(alone, c)[0] == pytest.approx(delivered * GB, rel=1e-9)
    assert fit_capacity(alone, 30.9 * GB) > fit_capacity(alone, 30.0 * GB) > fit_capacity(alone, 27 * GB)
    assert fit_capacity(alone, 31 * GB) is None and fit_capacity(alone, 32 * GB) is None  # nothing lost
    # The prediction at a capacity follows the curve; without a capacity (no loss) it is no slowdown.
    c = fit_capacity(alone, 30 * GB)
    assert predict(15 * GB, 16 * GB, c) == pytest.approx(
        together(alone, c)[1] / float(bwc.latency_factor(15 * GB / c)) - 1)
    assert predict(15 * GB, 16 * GB, None) == 0.0
    assert 0 < predict(15 * GB, 8 * GB, c) < predict(15 * GB, 16 * GB, c)  # less load, less slowdown


def test_summary_fits_the_capacity_to_the_peak_and_predicts_both_points_without_their_beside_phases():
    rounds = [_round(15, 16, 30, 14.6, 15.5, 7, 14.9), _round(16, 17, 32, 15.4, 16.4, 7.5, 15.8),
              _round(14, 15, 28, 13.7, 14.6, 6.5, 13.9)]
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3)
    bp, bh, peak, bt = 15 * GB, 16 * GB, 30 * GB, 7 * GB  # medians over rounds
    assert (c.probe_alone_bytes_per_second, c.hog_alone_bytes_per_second, c.peak_bytes_per_second) == (bp, bh, peak)
    assert c.peak_lost_share == pytest.approx(1 / 31)
    cap = fit_capacity([bp, bh], peak)
    assert c.fitted_capacity_bytes_per_second == cap and together([bp, bh], cap)[0] == pytest.approx(peak)
    assert c.peak_utilisation == pytest.approx(peak / cap)
    assert c.full.predicted_slowdown == pytest.approx(predict(bp, bh, cap))
    assert c.throttled.predicted_slowdown == pytest.approx(predict(bp, bt, cap))
    assert c.throttled.offered_load == pytest.approx((bp + bt) / cap)
    full = [15 / 14.6 - 1, 16 / 15.4 - 1, 14 / 13.7 - 1]
    thr = [15 / 14.9 - 1, 16 / 15.8 - 1, 14 / 13.9 - 1]
    assert c.full.measured_slowdown == pytest.approx(np.median(full))
    assert c.throttled.measured_slowdown == pytest.approx(np.median(thr))
    assert c.full.measured_slowdown_interval == (min(full), max(full))  # three values: the whole range
    for v in (c.full, c.throttled):
        assert v.error == pytest.approx(v.predicted_slowdown - v.measured_slowdown)
        assert v.within_tolerance == (abs(v.error) <= 0.25 * v.measured_slowdown)
        lo, hi = v.measured_slowdown_interval
        assert v.predicted_inside_measured_interval == (lo <= v.predicted_slowdown <= hi)
    assert c.within_tolerance == (c.full.within_tolerance and c.throttled.within_tolerance)
    assert c.verdict == ("within ±25%" if c.within_tolerance else "outside ±25%") and c.conclusive
    # The former readings, for comparison: the curve with C = the peak, and the hinge.
    assert c.full.predicted_slowdown_capacity_is_peak == pytest.approx(predict(bp, bh, peak))
    assert c.full.hinge_predicted_slowdown == pytest.approx((bp + bh) / peak - 1)
    assert c.throttled.hinge_predicted_slowdown == 0.0
    assert c.memory_bandwidth_cost_per_second == pytest.approx(4.0 * float(bwc.QUEUEING((bp + bh) / cap)))
    # What is checked enters neither the fit nor a prediction: other beside phases, same fit and predictions.
    other = summarise((0, 1), [0, 1], 64, [_round(15, 16, 30, 9, 9, 7, 11), _round(16, 17, 32, 9, 9, 7.5, 11),
                                           _round(14, 15, 28, 9, 9, 6.5, 11)], 0.2, weight=4.0, min_clean=3)
    assert other.fitted_capacity_bytes_per_second == cap
    assert other.full.predicted_slowdown == c.full.predicted_slowdown
    assert other.throttled.predicted_slowdown == c.throttled.predicted_slowdown
    assert other.full.measured_slowdown != c.full.measured_slowdown
    # A peak that lost more fits a smaller capacity and predicts more slowdown at both points.
    worse = summarise((0, 1), [0, 1], 64, [_round(15, 16, 27, 14, 15)] * 3, 0.2, weight=4.0, min_clean=3)
    assert worse.fitted_capacity_bytes_per_second < cap
    assert worse.full.predicted_slowdown > c.full.predicted_slowdown


def test_the_fit_counts_each_peak_stream_at_what_it_draws_alone_on_its_cpu():
    # The first hog (on the probe's CPU) as measured alone, not the probe: 15.5 GB/s.
    c = summarise((0, 1), [0, 1], 64, [_round(15, 16, 31, 14, 15, h0=15.5)] * 3, 0.2, weight=4.0, min_clean=3)
    assert c.first_hog_alone_bytes_per_second == 15.5 * GB
    assert c.fitted_capacity_bytes_per_second == pytest.approx(fit_capacity([15.5 * GB, 16 * GB], 31 * GB))
    assert c.peak_lost_share == pytest.approx(1 - 31 / 31.5)
    # Four peak workers: the first as measured alone, the three others as the hog alone.
    c = summarise((0, 1), [0, 1, 2, 3], 64, [_round(15, 16, 55, 14, 15, h0=14)] * 3, 0.2, weight=4.0, min_clean=3)
    assert c.fitted_capacity_bytes_per_second == pytest.approx(fit_capacity([14 * GB] + [16 * GB] * 3, 55 * GB))
    assert c.peak_lost_share == pytest.approx(1 - 55 / 62)


def test_a_peak_that_lost_nothing_fits_no_capacity_and_predicts_no_slowdown():
    c = summarise((0, 1), [0, 1], 64, [_round(15, 16, 31.5, 14.8, 15.8)] * 3, 0.2, weight=4.0, min_clean=3)
    assert c.fitted_capacity_bytes_per_second is None and c.peak_utilisation is None
    assert c.fitted_capacity_interval == (math.inf, math.inf)
    assert c.full.predicted_slowdown == 0.0 and c.throttled.predicted_slowdown == 0.0
    assert not c.within_tolerance and "no loss to fit" in c.verdict


def test_disturbed_rounds_are_left_out_of_the_measurement_and_of_the_prediction():
    good = [_round(14, 16, 27, 12, 15), _round(15, 17, 26, 11, 14), _round(13, 15, 28, 12, 16)]
    # Disturbed rounds with other figures for every phase: none of them may move any figure.
    bad = [_round(9, 30, 20, 14, 6, 3, 4, 2, 7, d=d) for d in (
        BUSY, Disturbance(foreign_share=0.3), Disturbance(hog_covered_probe=False),
        Disturbance(loader_share_lost=MAX_DISTURBANCE + 0.01))]
    c = summarise((0, 1), [0, 1], 64, bad[:2] + good + bad[2:], 0.2, weight=4.0, min_clean=3)
    assert c.clean_rounds == [2, 3, 4] and len(c.rounds) == 7
    keep = {"rounds": None, "clean_rounds": None}
    assert c.as_dict() | keep == summarise((0, 1), [0, 1], 64, good, 0.2, weight=4.0, min_clean=3).as_dict() | keep
    # At the threshold a round still counts; steal alone does not disturb (it is outside the workers' CPU time).
    edge = _round(14, 16, 27, 12, 15, d=Disturbance(loader_share_lost=MAX_DISTURBANCE, steal_share=0.5))
    assert edge.clean


def test_without_enough_clean_rounds_there_is_no_measured_figure():
    good = [_round(14, 16, 27, 12, 15)] * (MIN_CLEAN_ROUNDS - 1)
    c = summarise((0, 1), [0, 1], 64, good + [_round(9, 30, 20, 14, 6, d=BUSY)] * 40, 0.2, weight=4.0)
    assert not c.conclusive and c.verdict == f"not enough clean rounds: {MIN_CLEAN_ROUNDS - 1} of " \
                                             f"{MIN_CLEAN_ROUNDS + 39} (need {MIN_CLEAN_ROUNDS})"
    assert c.full is None and c.throttled is None and c.within_tolerance is None
    assert c.fitted_capacity_bytes_per_second is None
    assert len(c.rounds) == MIN_CLEAN_ROUNDS + 39  # every round is still in the report
    # One more clean round and it measures (no fallback to disturbed rounds either way).
    assert summarise((0, 1), [0, 1], 64, good * 2, 0.2, weight=4.0).conclusive


def test_summary_without_a_measured_phase_is_an_error():
    with pytest.raises(CalibrationError):
        summarise((0, 1), [0, 1], 64, [], 0.2, weight=4.0)
    with pytest.raises(CalibrationError):
        summarise((0, 1), [0, 1], 64, [_round(10, 0, 40, 9, 9)], 0.2, weight=4.0, min_clean=1)
    with pytest.raises(CalibrationError):
        summarise((0, 1), [0, 1], 64, [_round(10, 10, 19, 9, 9, 5, 0)], 0.2, weight=4.0, min_clean=1)


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
                          "--array-mib", "128"], capture_output=True, text=True, timeout=300, check=False)
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
        assert r["full"] is None and r["throttled"] is None and r["fitted_capacity_bytes_per_second"] is None
        return
    assert out.returncode == 0, out.stderr
    used = [r["rounds"][i] for i in clean]
    assert r["throttle_duty"] == 0.5
    for k in ("probe_alone_bytes_per_second", "hog_alone_bytes_per_second", "peak_bytes_per_second",
              "first_hog_alone_bytes_per_second"):
        assert r[k] > 1e8, (k, r)
        assert r[k] == pytest.approx(np.median([x[k] for x in used]))
    bp, bh = r["probe_alone_bytes_per_second"], r["hog_alone_bytes_per_second"]
    cap = r["fitted_capacity_bytes_per_second"]
    n = len(r["peak_cpus"])
    alone = [r["first_hog_alone_bytes_per_second"]] + [bh] * (n - 1)
    # The loss is paired within each round: the median of the rounds' own 1 − peak / Σ alone.
    lost = np.median([1 - x["peak_bytes_per_second"] / (x["first_hog_alone_bytes_per_second"]
                                                         + (n - 1) * x["hog_alone_bytes_per_second"]) for x in used])
    assert r["peak_lost_share"] == pytest.approx(lost)
    expected = fit_capacity(alone, (1 - lost) * sum(alone))
    assert cap == expected or cap == pytest.approx(expected)
    for name, hog in (("full", ""), ("throttled", "throttled_")):
        v = r[name]
        bt = np.median([x[f"{hog}hog_alone_bytes_per_second"] for x in used])
        assert v["hog_alone_bytes_per_second"] == pytest.approx(bt) and bt > 1e8
        slow = [x["probe_alone_bytes_per_second"] / x[f"probe_beside_{hog}hog_bytes_per_second"] - 1 for x in used]
        assert v["measured_slowdown"] == pytest.approx(np.median(slow))
        lo, hi = v["measured_slowdown_interval"]
        assert lo <= v["measured_slowdown"] <= hi
        assert v["predicted_slowdown"] == pytest.approx(predict(bp, bt, cap))
        assert v["error"] == pytest.approx(v["predicted_slowdown"] - v["measured_slowdown"])
        assert v["within_tolerance"] == (abs(v["error"]) <= 0.25 * abs(v["measured_slowdown"]))
    # The throttled hog offers less than the full one.
    assert r["throttled"]["hog_alone_bytes_per_second"] < 0.8 * bh
    assert r["within_tolerance"] == (r["full"]["within_tolerance"] and r["throttled"]["within_tolerance"])


def test_calibrate_rejects_bad_arguments_with_exit_2():
    for args in (["--seconds", "0"], ["--seconds", "2"], ["--hog", "spin"], ["--hog-duty", "1"]):
        out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", *args],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and args[0] in out.stderr, (args, out.stderr)


def _report(rounds, **settings) -> dict:
    """A report as ``--calibrate`` prints it (JSON), from rounds."""
    c = summarise((0, 1), [0, 1], 256, rounds, 0.2, weight=4.0, min_clean=3)
    return json.loads(json.dumps(c.as_dict() | settings))


def test_pooled_reports_are_summarised_over_all_their_rounds():
    a = [_round(15, 16, 30, 14.6, 15.5, 7, 14.9), _round(16, 17, 32, 15.4, 16.4, 7.5, 15.8),
         _round(14, 15, 28, 13.7, 14.6, 6.5, 13.9, d=BUSY)]
    b = [_round(15.5, 16, 31, 15, 15.5, 7, 15.3, h0=15.2), _round(15, 16.5, 31, 14.5, 16, 7.2, 14.8),
         _round(15, 16, 31, 14.6, 15.7, 7.1, 14.9)]
    pooled = pool([_report(a), _report(b)], weight=4.0)
    direct = summarise((0, 1), [0, 1], 256, a + b, 0.2, weight=4.0)
    assert pooled.clean_rounds == [0, 1, 3, 4, 5] and len(pooled.rounds) == 6
    assert pooled == direct


def test_pooling_reports_of_other_settings_or_no_report_is_an_error():
    rounds = [_round(15, 16, 30, 14.6, 15.5)] * 3
    with pytest.raises(CalibrationError, match="throttle_duty"):
        pool([_report(rounds), _report(rounds, throttle_duty=0.25)], weight=4.0)
    with pytest.raises(CalibrationError, match="not a calibration report"):
        pool([{"rounds": [{"probe_alone_bytes_per_second": 1.0}]}], weight=4.0)
    with pytest.raises(CalibrationError):
        pool([], weight=4.0)


def test_calibration_pool_cli_prints_the_pooled_report_and_rejects_a_bad_file(tmp_path):
    rounds = [_round(15, 16, 30, 14.6, 15.5, 7, 14.9), _round(16, 17, 32, 15.4, 16.4, 7.5, 15.8)] * 4
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(_report(rounds)))
    cmd = [sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibration-pool"]
    out = subprocess.run([*cmd, *map(str, paths)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert len(r["rounds"]) == 16 and r["clean_rounds"] == list(range(16)) and r["full"] is not None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = subprocess.run([*cmd, str(paths[0]), str(bad)], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--calibration-pool" in out.stderr


def test_pair_fit_takes_the_capacity_from_the_full_hog_phase_and_checks_only_the_throttled_one():
    rounds = [_round(15, 16, 30, 14.6, 15.5, 7, 14.9), _round(16, 17, 32, 15.4, 16.4, 7.5, 15.8),
              _round(14, 15, 28, 13.7, 14.6, 6.5, 13.9)]
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3)
    pf = c.pair_fit
    assert predict(15 * GB, 16 * GB, pf.fitted_capacity_bytes_per_second) == pytest.approx(c.full.measured_slowdown)
    assert pf.throttled_predicted_slowdown == pytest.approx(
        predict(15 * GB, 7 * GB, pf.fitted_capacity_bytes_per_second))
    assert pf.throttled_error == pytest.approx(pf.throttled_predicted_slowdown - c.throttled.measured_slowdown)
    assert pf.throttled_within_tolerance == (abs(pf.throttled_error) <= 0.25 * c.throttled.measured_slowdown)
    # The throttled beside phase enters neither fit: another one, same capacity and prediction.
    other = summarise((0, 1), [0, 1], 64, [_round(*r, pt=9) for r in ((15, 16, 30, 14.6, 15.5, 7),
                                                                     (16, 17, 32, 15.4, 16.4, 7.5),
                                                                     (14, 15, 28, 13.7, 14.6, 6.5))],
                      0.2, weight=4.0, min_clean=3)
    assert other.pair_fit.fitted_capacity_bytes_per_second == pf.fitted_capacity_bytes_per_second
    assert other.pair_fit.throttled_predicted_slowdown == pf.throttled_predicted_slowdown
    assert other.throttled.measured_slowdown != c.throttled.measured_slowdown
    # A probe that lost nothing beside the full hog fits no capacity and predicts nothing.
    none = summarise((0, 1), [0, 1], 64, [_round(15, 16, 30, 15, 16, 7, 15)] * 3, 0.2, weight=4.0, min_clean=3)
    assert none.pair_fit.fitted_capacity_bytes_per_second is None
    assert none.pair_fit.throttled_predicted_slowdown == 0.0


def test_the_peak_loss_is_paired_within_each_round_not_a_ratio_of_medians():
    # Every round lost 2 % of its own alone total; the medians of the levels (16, 16 and 29.4) would say 8 %.
    rounds = [_round(15, 16, 29.4, 14.7, 15.7, h0=14), _round(15, 14, 29.4, 14.7, 13.7, h0=16),
              _round(15, 16, 31.36, 14.7, 15.7, h0=16)]
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3)
    assert c.peak_lost_share == pytest.approx(0.02)
    assert c.fitted_capacity_bytes_per_second == pytest.approx(fit_capacity([16 * GB, 16 * GB], 0.98 * 32 * GB))


def test_with_the_probe_first_in_the_peak_the_fit_counts_it_at_the_probes_alone_rate():
    rounds = [_round(15, 16, 30.4, 14.6, 15.5, h0=14)] * 3
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3, peak_first="probe")
    assert c.peak_first == "probe" and c.peak_lost_share == pytest.approx(1 - 30.4 / 31)
    assert c.fitted_capacity_bytes_per_second == pytest.approx(fit_capacity([15 * GB, 16 * GB], 30.4 * GB))
    hog_first = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3)
    assert hog_first.peak_first == "hog" and hog_first.peak_lost_share == pytest.approx(1 - 30.4 / 30)
    # Reports of the two kinds are not pooled; a report from before the setting counts as "hog".
    with pytest.raises(CalibrationError, match="peak_first"):
        pool([_report(rounds), _report(rounds, peak_first="probe")], weight=4.0)
    old = _report(rounds)
    del old["peak_first"]
    assert pool([old, _report(rounds)], weight=4.0).peak_first == "hog"
