"""Intervals for the median of paired measurements (relay vs direct, same round), free of any assumption about
their distribution: the sign test's order-statistic interval, and a percentile bootstrap as a cross-check.

The sign-test interval for a median (Conover, *Practical Nonparametric Statistics*, 3rd ed., section 3.2, the
"confidence interval for a quantile"; the rank is the project's,
:func:`cri_resmgr.rebalancer.calibrate.sign_test_rank`): with the n values sorted, x(1) <= ... <= x(n), the
interval [x(k), x(n + 1 - k)] covers the median with probability 1 - 2 P(B <= k - 1), B ~ Binomial(n, 1/2). k is the
largest for which that is at least the confidence asked for. Pure functions: tested in
``tests/test_bench_paired.py`` against hand-computed binomial tails.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import NamedTuple

from cri_resmgr.rebalancer.calibrate import sign_test_rank  # the rank median_interval uses: one definition


class Interval(NamedTuple):
    low: float
    high: float
    coverage: float  # the interval's exact coverage (sign test) or the nominal one (bootstrap)


def binomial_half_cdf(n: int, k: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2), exactly (integers until the one division)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(min(k, n) + 1)) / 2 ** n


def sign_test_interval(xs: Sequence[float], confidence: float = 0.95) -> Interval | None:
    """The sign-test interval for the median of ``xs``; None when there are too few values for ``confidence``
    (fewer than 6 at 95 %)."""
    n = len(xs)
    k = sign_test_rank(n, confidence)
    if k == 0:
        return None
    s = sorted(xs)
    return Interval(s[k - 1], s[n - k], 1.0 - 2 * binomial_half_cdf(n, k - 1))


def bootstrap_interval(xs: Sequence[float], confidence: float = 0.95, resamples: int = 2000,
                       seed: int = 1) -> Interval:
    """Percentile bootstrap interval of the median of ``xs`` (seeded: the same data give the same interval)."""
    if not xs:
        raise ValueError("no values")
    rng = random.Random(seed)
    n = len(xs)
    meds = sorted(statistics.median(rng.choices(xs, k=n)) for _ in range(resamples))
    lo = int(math.floor((1.0 - confidence) / 2 * resamples))
    hi = min(resamples - 1, int(math.ceil((1.0 + confidence) / 2 * resamples)) - 1)
    return Interval(meds[lo], meds[hi], confidence)
