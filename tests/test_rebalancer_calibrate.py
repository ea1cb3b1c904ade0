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
    fit_capacity_to_slowdown,
    median_interval,
    parse_cpu_ticks,
    pool,
    predict,
    predict_bursts,
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
        # Up to three attempts: another process on the same CPU takes the worker's time for a slice and a spinning
        # worker then looks like a sleeping one; a worker that sleeps instead of spinning fails every attempt.
        failures = []
        for _ in range(3):
            rates: dict[float, list[float]] = {}
            cpu_seconds = []
            for duty in (1.0, 0.5, 1.0, 0.5):
                t = time.time() + 0.05
                p.stdin.write(f"{t} {t + 0.2} {duty}\n")
                p.stdin.flush()
                r = json.loads(p.stdout.readline())
                assert r["duty"] == duty
                cpu_seconds.append(r["cpu_seconds"])
                rates.setdefault(duty, []).append(r["bytes"] / r["cpu_seconds"])
            ratio = max(rates[0.5]) / min(rates[1.0])
            # It spins (its CPU stays busy); half the time streaming: well under the full rate, well over nothing
            # (the spin costs some time too).
            if min(cpu_seconds) > 0.15 and 0.2 < ratio < 0.75:
                break
            failures.append((cpu_seconds, ratio))
        else:
            raise AssertionError(f"CPU seconds per 0.2 s slice and rate ratio of each attempt: {failures}")
    finally:
        p.stdin.close()
        assert p.wait(timeout=30) == 0


CALM = Disturbance()


def _round(pa, ha, pk, pb, hb, ht=None, pt=None, htb=None, h0=None, ht2=None, pt2=None, ht2b=None, share=0.5,
           share2=0.75, d=CALM):
    """GB/s: probe alone, hog alone, peak, probe beside hog, hog beside probe, the throttled hog's three (by
    default 0.45 of the hog's load and a probe between alone and beside the full hog), the peak's first hog
    alone (by default as the probe), the second throttled hog's three (by default 0.7 of the hog's load), and the
    throttled hogs' stream shares."""
    ht = 0.45 * ha if ht is None else ht
    pt = (pa + pb) / 2 if pt is None else pt
    htb = ht if htb is None else htb
    h0 = pa if h0 is None else h0
    ht2 = 0.7 * ha if ht2 is None else ht2
    pt2 = (pa + 3 * pb) / 4 if pt2 is None else pt2
    ht2b = ht2 if ht2b is None else ht2b
    return Round(pa * GB, ha * GB, pk * GB, pb * GB, hb * GB, ht * GB, pt * GB, htb * GB, h0 * GB, ht2 * GB,
                 pt2 * GB, ht2b * GB, share, share2, d)


BUSY = Disturbance(loader_share_lost=0.5)  # a hog descheduled half its slice

# The curve's predictions at fixed inputs, computed outside the code under test: q(ρ) = 1 + 0.5 ρ + 8.3e-4 ρ / (1 − ρ)
# written out in Python's decimal module at 50 digits, ρ_beside solved by bisection of ρ q(ρ) = (B_p q(B_p / C)
# + B_h q(B_h / C)) / C, slowdown q(ρ_beside) / q(B_p / C) − 1; the time average 1 / ((1 − s) + s / (1 + full)) − 1.
FULL_15_16_AT_500 = 0.0153448232061587  # B_p 15, B_h 16, C 500 GB/s
BURSTS_HALF_AT_500 = 0.0076139939078748  # the same hog streaming half its time
FULL_15_16_AT_100 = 0.0659905622395905  # C 100 GB/s
BURSTS_THREE_QUARTERS_AT_100 = 0.0486896572159593  # streaming three quarters of its time


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


def test_predictions_at_fixed_inputs_match_the_curve_computed_independently():
    assert predict(15 * GB, 16 * GB, 500 * GB) == pytest.approx(FULL_15_16_AT_500, rel=1e-9)
    assert predict(15 * GB, 16 * GB, 100 * GB) == pytest.approx(FULL_15_16_AT_100, rel=1e-9)
    assert predict_bursts(15 * GB, 16 * GB, 0.5, 500 * GB) == pytest.approx(BURSTS_HALF_AT_500, rel=1e-9)
    assert predict_bursts(15 * GB, 16 * GB, 0.75, 100 * GB) == pytest.approx(BURSTS_THREE_QUARTERS_AT_100, rel=1e-9)
    # The time average by hand: streaming half the time beside a hog that slows the probe by 2 %, the probe moves
    # 0.5 + 0.5 / 1.02 of its alone bytes, a slowdown of 1 / 0.990196 − 1 = 0.01 / 1.01.
    assert predict_bursts(15 * GB, 16 * GB, 1.0, 500 * GB) == pytest.approx(FULL_15_16_AT_500, rel=1e-12)
    assert predict_bursts(15 * GB, 16 * GB, 0.0, 500 * GB) == 0.0
    assert predict_bursts(15 * GB, 16 * GB, 0.5, None) == 0.0
    # The capacity fitted to a slowdown is the one that predicts it.
    assert fit_capacity_to_slowdown(15 * GB, 16 * GB, FULL_15_16_AT_500) == pytest.approx(500 * GB, rel=1e-9)
    assert fit_capacity_to_slowdown(15 * GB, 16 * GB, FULL_15_16_AT_100) == pytest.approx(100 * GB, rel=1e-9)
    assert fit_capacity_to_slowdown(15 * GB, 16 * GB, 0.0) is None


def _slowed(pa: float, s: float) -> float:
    """The probe's rate beside a hog that slows it by ``s``."""
    return pa / (1 + s)


def test_summary_fits_the_capacity_to_the_full_hog_and_predicts_the_held_out_points_with_bursts():
    # Every round: the probe slowed by exactly the curve's slowdown at 500 GB/s beside the full hog, so the fit
    # is 500 GB/s; the throttled hogs stream 0.5 and 0.75 of their time.
    rounds = [_round(15, 16, 30.5, _slowed(15, FULL_15_16_AT_500), 15.7, ht=7.0, pt=14.9, ht2=11.5, pt2=14.8,
                     share=0.5, share2=0.75)] * 3
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3, duty=0.5, second_duty=0.75)
    assert (c.probe_alone_bytes_per_second, c.hog_alone_bytes_per_second) == (15 * GB, 16 * GB)
    assert c.fitted_capacity_bytes_per_second == pytest.approx(500 * GB, rel=1e-9)
    assert c.full.measured_slowdown == pytest.approx(FULL_15_16_AT_500)
    t, t2 = c.throttled, c.second_throttled
    assert (t.hog_duty, t.hog_stream_share, t2.hog_duty, t2.hog_stream_share) == (0.5, 0.5, 0.75, 0.75)
    assert t.predicted_slowdown == pytest.approx(BURSTS_HALF_AT_500, rel=1e-6)
    assert t.measured_slowdown == pytest.approx(15 / 14.9 - 1) and t2.measured_slowdown == pytest.approx(15 / 14.8 - 1)
    # 15 / 14.9 − 1 = 0.006711; predicted 0.007614: +13.4 %, within ±25 %, not inside a one-value interval.
    assert t.relative_error == pytest.approx(0.0076139939 / 0.0067114094 - 1, rel=1e-6)
    assert t.within_tolerance and not t.predicted_inside_measured_interval
    # The second point at 0.75 of 0.015345 averaged over time: 1 / (0.25 + 0.75 / 1.015345) − 1 = 0.011465 against
    # 15 / 14.8 − 1 = 0.013514: −15.2 %.
    assert t2.predicted_slowdown == pytest.approx(0.0114646367, rel=1e-6)
    assert t2.relative_error == pytest.approx(0.0114646367 / 0.0135135135 - 1, rel=1e-6)
    assert c.within_tolerance and c.verdict == "within ±25%" and c.conclusive
    # The former reading, the throttled hog as its mean load (7 GB/s), is the curve at 15 and 7.
    assert t.predicted_slowdown_mean_load == pytest.approx(predict(15 * GB, 7 * GB, 500 * GB))
    assert t.predicted_slowdown_mean_load < t.predicted_slowdown
    assert c.memory_bandwidth_cost_per_second == pytest.approx(4.0 * float(bwc.QUEUEING(31 / 500)), rel=1e-6)
    # What is checked enters neither the fit nor a prediction: other throttled beside phases, same predictions.
    other = summarise((0, 1), [0, 1], 64, [_round(15, 16, 30.5, _slowed(15, FULL_15_16_AT_500), 15.7, ht=7.0,
                                                  pt=12.0, ht2=11.5, pt2=11.0, htb=3.0, ht2b=4.0)] * 3,
                      0.2, weight=4.0, min_clean=3)
    assert other.fitted_capacity_bytes_per_second == c.fitted_capacity_bytes_per_second
    assert other.throttled.predicted_slowdown == t.predicted_slowdown
    assert other.second_throttled.predicted_slowdown == t2.predicted_slowdown
    assert other.throttled.measured_slowdown != t.measured_slowdown
    # A larger slowdown beside the full hog fits a smaller capacity and predicts more at both held-out points.
    worse = summarise((0, 1), [0, 1], 64, [_round(15, 16, 30.5, _slowed(15, FULL_15_16_AT_100), 15.7)] * 3, 0.2,
                      weight=4.0, min_clean=3)
    assert worse.fitted_capacity_bytes_per_second == pytest.approx(100 * GB, rel=1e-9)
    assert worse.throttled.predicted_slowdown > t.predicted_slowdown


def test_held_out_points_outside_the_tolerance_give_the_verdict_outside():
    # Measured 2 % at both throttled points, predicted 0.76 % and 1.15 %: −62 % and −43 %.
    rounds = [_round(15, 16, 30.5, _slowed(15, FULL_15_16_AT_500), 15.7, pt=_slowed(15, 0.02),
                     pt2=_slowed(15, 0.02))] * 3
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3)
    assert c.throttled.relative_error == pytest.approx(BURSTS_HALF_AT_500 / 0.02 - 1, rel=1e-6)
    assert not c.throttled.within_tolerance and not c.second_throttled.within_tolerance
    assert not c.within_tolerance and c.verdict == "outside ±25%"


def test_the_peak_fit_is_reported_beside_with_its_own_capacity_and_predictions():
    rounds = [_round(15, 16, 30.5, _slowed(15, FULL_15_16_AT_500), 15.7, pt=14.9, pt2=14.8, h0=15.5)] * 3
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3)
    pf = c.peak_fit
    # The peak phase lost 1 − 30.5 / (15.5 + 16) = 3.17 %; its capacity makes the pair deliver 30.5.
    assert pf.peak_lost_share == pytest.approx(1 - 30.5 / 31.5)
    assert pf.first_hog_alone_bytes_per_second == 15.5 * GB and pf.peak_bytes_per_second == 30.5 * GB
    cap = fit_capacity([15.5 * GB, 16 * GB], 30.5 * GB)
    assert pf.fitted_capacity_bytes_per_second == pytest.approx(cap)
    assert together([15.5 * GB, 16 * GB], cap)[0] == pytest.approx(30.5 * GB)
    assert pf.peak_utilisation == pytest.approx(30.5 * GB / cap)
    assert pf.full_predicted_slowdown == pytest.approx(predict(15 * GB, 16 * GB, cap))
    assert pf.full_relative_error == pytest.approx(pf.full_predicted_slowdown / FULL_15_16_AT_500 - 1)
    assert pf.throttled_predicted_slowdown == pytest.approx(predict_bursts(15 * GB, 16 * GB, 0.5, cap))
    assert pf.second_throttled_relative_error == pytest.approx(
        predict_bursts(15 * GB, 16 * GB, 0.75, cap) / (15 / 14.8 - 1) - 1)
    # It is not the verdict: the main fit is still the full hog's 500 GB/s.
    assert c.fitted_capacity_bytes_per_second == pytest.approx(500 * GB, rel=1e-9)
    # Four peak workers: the first as measured alone, the three others as the hog alone.
    c = summarise((0, 1), [0, 1, 2, 3], 64, [_round(15, 16, 55, 14, 15, h0=14)] * 3, 0.2, weight=4.0, min_clean=3)
    assert c.peak_fit.fitted_capacity_bytes_per_second == pytest.approx(
        fit_capacity([14 * GB] + [16 * GB] * 3, 55 * GB))
    assert c.peak_fit.peak_lost_share == pytest.approx(1 - 55 / 62)


def test_a_probe_that_lost_nothing_beside_the_full_hog_fits_no_capacity_and_predicts_no_slowdown():
    c = summarise((0, 1), [0, 1], 64, [_round(15, 16, 31, 15, 16, pt=14.9, pt2=14.9)] * 3, 0.2, weight=4.0,
                  min_clean=3)
    assert c.fitted_capacity_bytes_per_second is None
    assert c.fitted_capacity_interval == (math.inf, math.inf)
    assert c.throttled.predicted_slowdown == 0.0 and c.second_throttled.predicted_slowdown == 0.0
    assert not c.within_tolerance and "no slowdown to fit" in c.verdict
    assert c.peak_fit.fitted_capacity_bytes_per_second is None  # the peak lost nothing either (31 of 15 + 16)


def test_disturbed_rounds_are_left_out_of_the_measurement_and_of_the_prediction():
    good = [_round(14, 16, 27, 12, 15), _round(15, 17, 26, 11, 14), _round(13, 15, 28, 12, 16)]
    # Disturbed rounds with other figures for every phase: none of them may move any measured figure.
    bad = [_round(9, 30, 20, 14, 6, 3, 4, 2, 7, 5, 8, 4, 0.3, 0.9, d=d) for d in (
        BUSY, Disturbance(hog_covered_probe=False), Disturbance(loader_share_lost=MAX_DISTURBANCE + 0.01))]
    c = summarise((0, 1), [0, 1], 64, bad[:2] + good + bad[2:], 0.2, weight=4.0, min_clean=3)
    assert c.clean_rounds == [2, 3, 4] and len(c.rounds) == 6
    keep = {"rounds": None, "clean_rounds": None}
    assert c.as_dict() | keep == summarise((0, 1), [0, 1], 64, good, 0.2, weight=4.0, min_clean=3).as_dict() | keep
    # At the threshold a round still counts; others' time on the measured worker (foreign) and steal do not
    # disturb (its bandwidth is over its own CPU time), they are reported.
    edge = _round(14, 16, 27, 12, 15, d=Disturbance(loader_share_lost=MAX_DISTURBANCE, foreign_share=0.4,
                                                    steal_share=0.3))
    assert edge.clean


def test_foreign_share_is_reported_over_every_round_clean_or_not():
    ds = [Disturbance(foreign_share=f, steal_share=f / 2) for f in (0.01, 0.02, 0.03)] + [
        Disturbance(loader_share_lost=0.5, foreign_share=0.5, steal_share=0.2)]
    c = summarise((0, 1), [0, 1], 64, [_round(14, 16, 27, 12, 15, d=d) for d in ds], 0.2, weight=4.0, min_clean=3)
    assert c.clean_rounds == [0, 1, 2]
    assert c.foreign_share == pytest.approx(0.025)  # the median of 0.01, 0.02, 0.03 and 0.5
    assert c.foreign_share_max == 0.5
    assert c.steal_share == pytest.approx(0.0125)  # the median of 0.005, 0.01, 0.015 and 0.2


def test_without_enough_clean_rounds_there_is_no_measured_figure():
    good = [_round(14, 16, 27, 12, 15)] * (MIN_CLEAN_ROUNDS - 1)
    c = summarise((0, 1), [0, 1], 64, good + [_round(9, 30, 20, 14, 6, d=BUSY)] * 40, 0.2, weight=4.0)
    assert not c.conclusive and c.verdict == f"not enough clean rounds: {MIN_CLEAN_ROUNDS - 1} of " \
                                             f"{MIN_CLEAN_ROUNDS + 39} (need {MIN_CLEAN_ROUNDS})"
    assert c.full is None and c.throttled is None and c.second_throttled is None and c.within_tolerance is None
    assert c.fitted_capacity_bytes_per_second is None and c.peak_fit is None
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
    with pytest.raises(CalibrationError):
        summarise((0, 1), [0, 1], 64, [_round(10, 10, 19, 9, 9, pt2=0)], 0.2, weight=4.0, min_clean=1)


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


def test_parse_cpu_ticks_reads_steal_per_cpu():
    t = parse_cpu_ticks(STAT)
    assert set(t) == {0, 1}  # the total line, a short line and a malformed one are skipped
    assert t == {0: CpuTicks(steal=90663), 1: CpuTicks(steal=93746)}
    assert parse_cpu_ticks("") == {}


def _slice(cpu: int, cpu_seconds: float, wall: float = 0.2) -> SliceResult:
    return SliceResult("hog", cpu, 10**9, cpu_seconds, wall, [cpu], 0.0, wall)


def test_disturbance_counts_loaders_not_the_measured_workers_own_lost_time_and_reports_foreign_time():
    before = {0: CpuTicks(10), 1: CpuTicks(20)}
    # The probe on CPU 0 lost half its slice (its bandwidth is over its own CPU time: no disturbance, but foreign
    # time reported: 50 %); its CPU had 5 ticks of steal in 0.2 s at 100 Hz: 25 %. The spinner on CPU 1 ran.
    d = disturbance([_slice(0, 0.1), _slice(1, 0.2)], [1], before, {0: CpuTicks(15), 1: CpuTicks(20)}, 0.2, 100.0)
    assert d == Disturbance(loader_share_lost=0.0, foreign_share=pytest.approx(0.5), steal_share=pytest.approx(0.25))
    assert d.share == 0.0
    # A loader (the hog beside the probe, or a spinner) that ran 70 % of its slice is a disturbance of 30 %.
    d = disturbance([_slice(1, 0.14), _slice(0, 0.2)], [0], before, before, 0.2, 100.0)
    assert d.loader_share_lost == pytest.approx(0.3) and d.foreign_share == pytest.approx(0.3)
    assert d.share == d.loader_share_lost
    # No /proc/stat: no steal figure, the workers' own lost time still shows.
    assert disturbance([_slice(1, 0.2)], [0], {}, {}, 0.2, 100.0) == Disturbance()
    worst = Disturbance.worst([Disturbance(0.05, 0.0, 0.1), Disturbance(0.0, 0.2, 0.0, hog_covered_probe=False)])
    assert worst == Disturbance(0.05, 0.2, 0.1, False) and worst.share == 1.0


def test_a_spinner_keeps_its_cpu_busy_without_moving_memory():
    cpu = max(os.sched_getaffinity(0))
    p = _worker("hog", cpu, 32, "read")
    try:
        assert p.stdout.readline().strip() == "ready"
        t = time.time() + 0.05
        p.stdin.write(f"{t} {t + 0.2} 0\n")
        p.stdin.flush()
        r = SliceResult(**json.loads(p.stdout.readline()))
        assert r.bytes == 0 and r.stream_seconds == 0.0 and r.stream_share == 0.0
        assert r.cpu_seconds > 0.1  # it spins: its CPU stays busy
    finally:
        p.stdin.close()
        assert p.wait(timeout=30) == 0


@needs_two_cpus
def test_calibrate_measures_hog_beside_probe_and_reports_the_prediction_or_says_it_could_not():
    out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", "--seconds", "3",
                          "--array-mib", "128", "--second-hog-duty", "0.7"], capture_output=True, text=True,
                         timeout=300, check=False)
    r = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    a, b = r["cpus"]
    assert a != b and r["peak_cpus"][:2] == [a, b] and r["hog"] == "read"
    assert (r["throttle_duty"], r["second_throttle_duty"]) == (0.5, 0.7)
    wanted = round(3 / r["slice_seconds"])
    clean = [i for i, x in enumerate(r["rounds"]) if x["disturbance"]["loader_share_lost"] <= MAX_DISTURBANCE
             and x["disturbance"]["hog_covered_probe"]]
    assert r["clean_rounds"] == clean
    assert 0.0 <= r["foreign_share"] <= r["foreign_share_max"] <= 1.0
    # It stops at the wanted number of clean rounds, or at four times as many rounds.
    assert len(clean) == wanted or (len(clean) < wanted and len(r["rounds"]) == 4 * wanted)
    if len(clean) < MIN_CLEAN_ROUNDS:
        assert out.returncode == 1 and "not enough clean rounds" in out.stderr
        assert r["full"] is None and r["throttled"] is None and r["fitted_capacity_bytes_per_second"] is None
        return
    assert out.returncode == 0, out.stderr
    used = [r["rounds"][i] for i in clean]
    for k in ("probe_alone_bytes_per_second", "hog_alone_bytes_per_second"):
        assert r[k] > 1e8, (k, r)
        assert r[k] == pytest.approx(np.median([x[k] for x in used]))
    bp, bh = r["probe_alone_bytes_per_second"], r["hog_alone_bytes_per_second"]
    cap = r["fitted_capacity_bytes_per_second"]
    slow = [x["probe_alone_bytes_per_second"] / x["probe_beside_hog_bytes_per_second"] - 1 for x in used]
    assert r["full"]["measured_slowdown"] == pytest.approx(np.median(slow))
    if cap is not None:  # the fit reproduces the measured slowdown beside the full hog
        assert predict(bp, bh, cap) == pytest.approx(r["full"]["measured_slowdown"], rel=1e-6)
    for name, hog, duty in (("throttled", "throttled_", 0.5), ("second_throttled", "second_throttled_", 0.7)):
        v = r[name]
        bt = np.median([x[f"{hog}hog_alone_bytes_per_second"] for x in used])
        assert v["hog_alone_bytes_per_second"] == pytest.approx(bt) and 1e8 < bt < 0.9 * bh
        share = np.median([x[f"{hog}hog_stream_share"] for x in used])
        assert v["hog_stream_share"] == pytest.approx(share) and duty - 0.15 < share <= duty + 0.05
        slow = [x["probe_alone_bytes_per_second"] / x[f"probe_beside_{hog}hog_bytes_per_second"] - 1 for x in used]
        assert v["measured_slowdown"] == pytest.approx(np.median(slow))
        lo, hi = v["measured_slowdown_interval"]
        assert lo <= v["measured_slowdown"] <= hi
        assert v["predicted_slowdown"] == pytest.approx(predict_bursts(bp, bh, share, cap))
        assert v["error"] == pytest.approx(v["predicted_slowdown"] - v["measured_slowdown"])
        assert v["within_tolerance"] == (abs(v["error"]) <= 0.25 * abs(v["measured_slowdown"]))
    assert r["within_tolerance"] == (r["throttled"]["within_tolerance"]
                                     and r["second_throttled"]["within_tolerance"])
    assert r["peak_fit"]["peak_bytes_per_second"] > bp


def test_calibrate_rejects_bad_arguments_with_exit_2():
    for args in (["--seconds", "0"], ["--seconds", "2"], ["--hog", "spin"], ["--hog-duty", "1"],
                 ["--second-hog-duty", "0"]):
        out = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--calibrate", *args],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and args[0] in out.stderr, (args, out.stderr)


def _report(rounds, **settings) -> dict:
    """A report as ``--calibrate`` prints it (JSON), from rounds."""
    c = summarise((0, 1), [0, 1], 256, rounds, 0.2, weight=4.0, min_clean=3)
    return json.loads(json.dumps(c.as_dict() | settings))


def test_pooled_reports_are_summarised_over_all_their_rounds():
    a = [_round(15, 16, 30, 14.6, 15.5, 7, 14.9, share=0.48), _round(16, 17, 32, 15.4, 16.4, 7.5, 15.8),
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
    with pytest.raises(CalibrationError, match="second_throttle_duty"):
        pool([_report(rounds), _report(rounds, second_throttle_duty=0.6)], weight=4.0)
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


def test_the_peak_loss_is_paired_within_each_round_not_a_ratio_of_medians():
    # Every round lost 2 % of its own alone total; the medians of the levels (16, 16 and 29.4) would say 8 %.
    rounds = [_round(15, 16, 29.4, 14.7, 15.7, h0=14), _round(15, 14, 29.4, 14.7, 13.7, h0=16),
              _round(15, 16, 31.36, 14.7, 15.7, h0=16)]
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3).peak_fit
    assert c.peak_lost_share == pytest.approx(0.02)
    assert c.fitted_capacity_bytes_per_second == pytest.approx(fit_capacity([16 * GB, 16 * GB], 0.98 * 32 * GB))


def test_with_the_probe_first_in_the_peak_the_fit_counts_it_at_the_probes_alone_rate():
    rounds = [_round(15, 16, 30.4, 14.6, 15.5, h0=14)] * 3
    c = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3, peak_first="probe")
    assert c.peak_first == "probe" and c.peak_fit.peak_lost_share == pytest.approx(1 - 30.4 / 31)
    assert c.peak_fit.fitted_capacity_bytes_per_second == pytest.approx(
        fit_capacity([15 * GB, 16 * GB], 30.4 * GB))
    hog_first = summarise((0, 1), [0, 1], 64, rounds, 0.2, weight=4.0, min_clean=3)
    assert hog_first.peak_first == "hog" and hog_first.peak_fit.peak_lost_share == pytest.approx(1 - 30.4 / 30)
    # Reports of the two kinds are not pooled; a report from before the setting counts as "hog".
    with pytest.raises(CalibrationError, match="peak_first"):
        pool([_report(rounds), _report(rounds, peak_first="probe")], weight=4.0)
    old = _report(rounds)
    del old["peak_first"]
    assert pool([old, _report(rounds)], weight=4.0).peak_first == "hog"
