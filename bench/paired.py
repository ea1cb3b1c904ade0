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
make one sample per target, so that runs of the same code narrow one interval instead of giving several wide ones.
With ``--calls`` it pools phase 2's unary calls instead (Version and ListContainers under load): each target's
calls of all runs make one distribution, and its p50 and p99 less the baseline's come with a block-bootstrap
interval (:func:`quantile_difference`):

    .venv/bin/python bench/paired.py RUN.json [RUN.json ...] [--baseline TARGET] [--calls]
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

# bench/relay_bench.py --save: {"format", "commit", "time", "block", "lifecycles"} (phase 3, when run) and "calls"
# (phase 2, when run: method -> target -> seconds of each call, in the order of the rounds)
RUN_FORMAT = 1


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


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile as the bench reports it: the value of rank floor(q n) + 1 (of n, sorted; the last for
    q = 1), so that p99 of 5,000 calls is the 50th slowest."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def quantile_difference(runs: Sequence[Mapping[str, Sequence[float]]], target: str, baseline: str, q: float,
                        block: int = 100, confidence: float = 0.95, resamples: int = 1000,
                        seed: int = 1) -> tuple[float, Interval]:
    """The ``q`` quantile (:func:`pct`) of ``target``'s values of all ``runs`` pooled, less ``baseline``'s, and a
    percentile interval for that difference from a block bootstrap that keeps the pairing: within each run the
    rounds (the i-th value of every target came from the same round, run back to back) are cut into blocks of
    ``block`` consecutive rounds, and each resample draws, run by run, as many blocks as the run has, with
    replacement, the same blocks for both targets. Blocks, not single calls, because a loaded machine's slow
    calls come in bursts (a scrape, a collector cycle); a run's tail rounds short of a whole block are left out
    of the resamples (not of the estimate)."""
    import numpy as np  # the bench's dependency (the project's too); only this function needs it

    if not runs or any(target not in r or baseline not in r for r in runs):
        raise ValueError(f"every run needs values of {target!r} and {baseline!r}")
    a = [np.asarray(r[target], dtype=np.float64) for r in runs]
    b = [np.asarray(r[baseline], dtype=np.float64) for r in runs]
    if any(len(x) != len(y) or len(x) == 0 for x, y in zip(a, b, strict=True)):
        raise ValueError(f"{target!r} and {baseline!r} need the same, non-zero number of values in each run")
    estimate = pct(np.concatenate(a).tolist(), q) - pct(np.concatenate(b).tolist(), q)
    blocks = [(x[:len(x) // block * block].reshape(-1, block), y[:len(y) // block * block].reshape(-1, block))
              for x, y in zip(a, b, strict=True) if len(x) >= block]
    if not blocks:
        raise ValueError(f"no run has a whole block of {block} rounds")
    n = sum(bx.size for bx, _ in blocks)
    k = min(n - 1, int(q * n))
    rng = np.random.default_rng(seed)
    diffs = np.empty(resamples)
    for i in range(resamples):
        picks = [rng.integers(0, len(bx), len(bx)) for bx, _ in blocks]
        xa = np.concatenate([bx[p].ravel() for (bx, _), p in zip(blocks, picks, strict=True)])
        xb = np.concatenate([by[p].ravel() for (_, by), p in zip(blocks, picks, strict=True)])
        diffs[i] = np.partition(xa, k)[k] - np.partition(xb, k)[k]
    diffs.sort()
    lo = int(math.floor((1.0 - confidence) / 2 * resamples))
    hi = min(resamples - 1, int(math.ceil((1.0 + confidence) / 2 * resamples)) - 1)
    return estimate, Interval(float(diffs[lo]), float(diffs[hi]), confidence)


class RunError(ValueError):
    """A saved run that cannot be pooled: the message names the file and what is wrong with it."""


def _check_format(doc: Any, name: str) -> None:
    if not isinstance(doc, Mapping) or doc.get("format") != RUN_FORMAT:
        raise RunError(f"{name}: not a relay_bench.py --save file of format {RUN_FORMAT}")


def run_ratios(doc: Any, name: str, baseline: str = "direct") -> dict[str, list[float]]:
    """One saved run's paired ratios, target / baseline - 1 of whole lifecycles (the sum of a lifecycle's calls),
    per target other than the baseline, in the order run. A baseline other than direct (``--baseline alt2``)
    compares two relay trees that ran in the same kind of slot, each lifecycle with the other's of the same round
    and place in the block."""
    _check_format(doc, name)
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


def run_calls(doc: Any, name: str, baseline: str = "direct") -> dict[str, dict[str, list[float]]]:
    """One saved run's phase 2 calls: method -> target -> seconds of each call, in round order; every target of
    a method with as many calls as the baseline."""
    _check_format(doc, name)
    calls = doc.get("calls")
    if not isinstance(calls, Mapping) or not calls:
        raise RunError(f"{name}: no phase 2 calls (run relay_bench.py with --phases including 2 and --save)")
    out: dict[str, dict[str, list[float]]] = {}
    for method, per in calls.items():
        if not isinstance(per, Mapping) or baseline not in per:
            raise RunError(f"{name}: {method}: no {baseline} calls to compare with")
        out[str(method)] = {}
        for target, xs in per.items():
            if not isinstance(xs, list) or not xs or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in xs):
                raise RunError(f"{name}: {method}: target {target!r}: calls must be a list of seconds (> 0)")
            if len(xs) != len(per[baseline]):
                raise RunError(f"{name}: {method}: target {target!r} has {len(xs)} calls, {baseline} "
                               f"{len(per[baseline])}")
            out[str(method)][str(target)] = [float(v) for v in xs]
    return out


def pooled_calls(runs: Sequence[Mapping[str, Mapping[str, list[float]]]], baseline: str) -> None:
    """Print, per method, each target's pooled p50 and p99 less the baseline's with their intervals."""
    methods = [m for m in runs[0] if all(m in r for r in runs)]
    print(f"pooled over {len(runs)} runs: each target's pooled p50 and p99 less {baseline}'s, ms, 95 % interval "
          "(block bootstrap, blocks of 100 rounds)")
    for method in methods:
        per = [r[method] for r in runs]
        targets = [t for t in per[0] if t != baseline and all(t in p for p in per)]
        base = [x for p in per for x in p[baseline]]
        print(f"  {method} ({len(base)} calls per target; {baseline} p50 {1e3 * pct(base, 0.5):.3f} ms, "
              f"p99 {1e3 * pct(base, 0.99):.3f} ms)")
        for target in targets:
            parts = []
            for q in (0.5, 0.99):
                est, iv = quantile_difference(per, target, baseline, q)
                parts.append(f"p{round(100 * q)} {1e3 * est:+.3f} [{1e3 * iv.low:+.3f}, {1e3 * iv.high:+.3f}]")
            print(f"    {target:7s} " + "   ".join(parts))


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
    ap.add_argument("--calls", action="store_true",
                    help="pool phase 2's calls (Version, ListContainers under load) instead of the lifecycles: "
                         "pooled p50 and p99 less the baseline's, with block-bootstrap intervals")
    args = ap.parse_args(argv)
    runs: list[Any] = []
    for path in args.runs:
        try:
            doc = json.loads(path.read_text())
            if args.calls:
                runs.append(run_calls(doc, str(path), args.baseline))
                print(f"{path}: commit {doc.get('commit') or '?'}, {doc.get('time') or '?'}, "
                      + ", ".join(f"{m}: {len(p[args.baseline])} calls per target" for m, p in runs[-1].items()))
                continue
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
    if args.calls:
        pooled_calls(runs, args.baseline)
        return 0
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
