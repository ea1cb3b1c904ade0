"""The bandwidth term's queueing curve: it reproduces the published loaded-latency points it was fitted to,
its piecewise-linear form is convex, meets the exact curve at the breakpoints and stays close between them,
and far beyond capacity it becomes the former hinge (one capacity of excess costs the weight)."""

from __future__ import annotations

import numpy as np
import pytest

from cri_resmgr.rebalancer import bandwidth_curve as bwc

# MLC --loaded_latency, Xeon Silver 4110, 12 × DDR4-2666 (the run cited in bandwidth_curve.py):
# (bandwidth MB/s, latency ns); idle 81.96 ns, peak 135655.9 MB/s.
PUBLISHED = [(131282.0, 123.71), (68357.8, 98.94), (42695.4, 94.56), (29473.3, 92.29), (13463.5, 88.79)]


def test_latency_factor_follows_the_published_loaded_latency_run():
    for bw, lat in PUBLISHED:
        assert float(bwc.latency_factor(bw / 135655.9)) == pytest.approx(lat / 81.96, abs=0.05)


def test_achieved_utilisation_solves_the_closed_loop():
    x = np.array([0.0, 0.3, 0.9, 1.2, 3.0])
    rho = bwc.achieved(x)
    assert np.all((rho >= 0) & (rho < 1))
    assert rho * bwc.latency_factor(rho) == pytest.approx(x, abs=1e-9)


def test_piecewise_linear_cost_is_convex_exact_at_breakpoints_and_close_between():
    c = bwc.QUEUEING
    assert list(c.slopes) == sorted(c.slopes) and c.slopes[0] >= 0 and c.slopes[-1] == 1.0
    bp = np.array(bwc.BREAKPOINTS)
    assert c(bp) == pytest.approx(bwc.lost(bp), abs=1e-12)
    x = np.linspace(0, 4, 401)
    gap = c(x) - bwc.lost(x)
    assert gap.min() >= -1e-12  # chords of a convex curve lie above it
    assert gap.max() < 0.01  # within 1 % of a capacity everywhere
    assert float(c(0.0)) == 0.0


def test_far_beyond_capacity_the_cost_is_the_excess():
    for x in (5.0, 8.0):
        assert float(bwc.QUEUEING(x)) == pytest.approx(x - 1.0, abs=1e-3)
        assert float(bwc.slowdown_factor(x)) == pytest.approx(x, rel=1e-3)  # fair share of the capacity


def test_slowdown_grows_with_load_and_is_one_plus_the_latency_rise():
    x = np.array([0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 1.5])
    f = bwc.slowdown_factor(x)
    assert np.all(np.diff(f) >= 0) and np.all(np.diff(f[1:]) > 0)  # constant on the first chord only
    assert 1.0 < f[0] < 1.03  # the first chord is short: little slowdown on an idle domain
    # Between breakpoints the model uses its own piecewise-linear curve; at one it is q(ρ(x)).
    assert float(bwc.slowdown_factor(1.0)) == pytest.approx(float(bwc.latency_factor(bwc.achieved(1.0))), rel=1e-9)
    # The hinge predicts nothing below capacity.
    assert float(bwc.slowdown_factor(0.8, bwc.HINGE)) == 1.0
