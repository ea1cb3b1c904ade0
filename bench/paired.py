"""Intervals for the median of paired measurements (relay vs direct, same round), free of any assumption about
their distribution: the sign test's order-statistic interval, and a percentile bootstrap as a cross-check.

The sign-test interval for a median (Conover, *Practical Nonparametric Statistics*, 3rd ed., section 3.2, the
"confidence interval for a quantile"; the rank is the project's,
:func:`cri_resmgr.rebalancer.calibrate.sign_test_rank`): with the n values sorted, x(1) <= ... <= x(n), the
interval [x(k), x(n + 1 - k)] covers the median with probability 1 - 2 P(B <= k - 1), B ~ Binomial(n, 1/2). k is the
largest for which that is at least the confidence asked for. Pure functions: tested in
``tests/test_bench_paired.py`` against hand-computed binomial tails.

Run as a program, it pools the pod lifecycles of several ``bench/relay_bench.py --save FILE`` runs: within each
run a target's i-th lifecycle is paired with direct's i-th (as the bench pairs them), and the ratios of all runs
make one sample per target, so that runs of the same code narrow one interval instead of giving several wide ones:

    .venv/bin/python bench/paired.py RUN.json [RUN.json ...] [--baseline TARGET]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from cri_resmgr.rebalancer.calibrate import sign_test_rank  # the rank median_interval uses: one definition

LIFECYCLES_FORMAT = 1  # bench/relay_bench.py --save: {"format", "commit", "time", "block", "lifecycles"}


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


class RunError(ValueError):
    """A saved run that cannot be pooled: the message names the file and what is wrong with it."""


def run_ratios(doc: Any, name: str, baseline: str = "direct") -> dict[str, list[float]]:
    """One saved run's paired ratios, target / baseline - 1 of whole lifecycles (the sum of a lifecycle's calls),
    per target other than the baseline, in the order run. A baseline other than direct (``--baseline alt2``)
    compares two relay trees that ran in the same kind of slot, each lifecycle with the other's of the same round
    and place in the block."""
    if not isinstance(doc, Mapping) or doc.get("format") != LIFECYCLES_FORMAT:
        raise RunError(f"{name}: not a relay_bench.py --save file of format {LIFECYCLES_FORMAT}")
    per = doc.get("lifecycles")
    if not isinstance(per, Mapping) or baseline not in per:
        raise RunError(f"{name}: no {baseline} lifecycles to pair with")
    totals: dict[str, list[float]] = {}
    for target, runs in per.items():
        if not isinstance(runs, list) or not all(
                isinstance(t, Mapping) and t and all(isinstance(v, (int, float)) and v > 0 for v in t.values())
                for t in runs):
            raise RunError(f"{name}: target {target!r}: lifecycles must be a list of call -> seconds (> 0)")
        totals[str(target)] = [float(sum(t.values())) for t in runs]
    base = totals.pop(baseline)
    out: dict[str, list[float]] = {}
    for target, xs in totals.items():
        if len(xs) != len(base):
            raise RunError(f"{name}: target {target!r} has {len(xs)} lifecycles, {baseline} {len(base)}")
        out[target] = [a / b - 1 for a, b in zip(xs, base, strict=True)]
    return out


def pool(runs: Sequence[Mapping[str, list[float]]]) -> dict[str, list[float]]:
    """The runs' ratios, target by target (each run's pairs stay within their run); a target missing from a run
    is pooled over the runs that have it."""
    out: dict[str, list[float]] = {}
    for r in runs:
        for target, xs in r.items():
            out.setdefault(target, []).extend(xs)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Pool the paired pod lifecycles of relay_bench.py --save runs: "
                                             "median of target / direct - 1 (or --baseline) with its 95 % intervals.")
    ap.add_argument("runs", nargs="+", type=Path, metavar="RUN.json")
    ap.add_argument("--baseline", default="direct", metavar="TARGET",
                    help="pair each target with this one instead of direct (e.g. alt2: two relay trees that "
                         "ran in the same kind of slot)")
    args = ap.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            doc = json.loads(path.read_text())
            runs.append(run_ratios(doc, str(path), args.baseline))
        except (OSError, UnicodeDecodeError) as e:
            print(f"paired: {path}: {e.strerror if isinstance(e, OSError) else e}", file=sys.stderr)
            return 2
        except json.JSONDecodeError as e:
            print(f"paired: {path}: not JSON ({e.msg}, line {e.lineno})", file=sys.stderr)
            return 2
        except RunError as e:
            print(f"paired: {e}", file=sys.stderr)
            return 2
        print(f"{path}: commit {doc.get('commit') or '?'}, {doc.get('time') or '?'}, "
              + ", ".join(f"{k} {100 * statistics.median(v):+.2f} % (n={len(v)})" for k, v in runs[-1].items()))
    print(f"pooled over {len(runs)} runs: median of target / {args.baseline} - 1, 95 % interval "
          "(sign test; bootstrap)")
    for target, ratios in pool(runs).items():
        st, bs = sign_test_interval(ratios), bootstrap_interval(ratios)
        sign = "n/a" if st is None else f"[{100 * st.low:+.2f}, {100 * st.high:+.2f}] ({100 * st.coverage:.1f} %)"
        print(f"  {target:7s} {100 * statistics.median(ratios):+.2f} %  sign test {sign}; "
              f"bootstrap [{100 * bs.low:+.2f}, {100 * bs.high:+.2f}]  (n={len(ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
