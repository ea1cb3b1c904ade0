"""The memory-bandwidth term's cost curve: queueing in a memory domain as a convex piecewise-linear function.

A memory domain (a NUMA node, or an L3 domain with its own link to memory) serves requests with a
latency that grows with its utilisation ρ = achieved bandwidth / peak bandwidth — the *loaded-latency*
curve that Intel's Memory Latency Checker measures (``mlc --loaded_latency``: one core chases
pointers while the others inject bandwidth at decreasing delays). Its shape here is fitted once, by
least squares, to a published MLC run (MLC v3.5 on a Xeon Silver 4110 with 12 × DDR4-2666, posted on
Intel's community forum, "Intel Memory Latency Checker v3.5 test"): idle 82.0 ns at 1.2 GB/s, 94.6 ns
at 42.7 GB/s, 98.9 ns at 68.4 GB/s, 123.7 ns at 131.3 GB/s, peak 135.7 GB/s. With ρ the bandwidth over
the peak and q the latency over the idle latency::

    q(ρ) = 1 + LINEAR × ρ + POLE × ρ / (1 − ρ)          LINEAR = 0.50, POLE = 8.3e-4

(largest residual 0.046 at ρ = 0.5; q(0.97) = 1.51 as measured). Nothing of the machine it is used on
goes into the shape: only the domain's capacity (``numa_bandwidth_bytes_per_second``), which
``cri-resmgr rebalance --calibrate`` fits to the measured slowdown of a memory-bound probe beside a
full bandwidth hog — the capacity at which this curve predicts that slowdown — and checks at two held-out
loads; on a node whose cores can saturate its memory that is near the peak they reach, on a small VM slice
of a big server far above it (docs/rebalancer.md, *Calibration*: 422 GB/s pooled on a 2-vCPU slice that
draws 31 GB/s).

Memory-bound work is closed-loop: a container that waits longer for memory issues its requests more
slowly, so with offered load ``x = Σ bandwidth / capacity`` (the containers' bandwidths as measured,
each where it ran) the domain settles where ``x = ρ × q(ρ)``: everyone is slowed by ``q(ρ) = x / ρ``
and the domain delivers ``ρ``. The term's cost is the bandwidth lost to that, in capacities::

    lost(x) = x − ρ(x)

zero at ``x = 0`` with zero slope, convex (``x(ρ)`` is convex and increasing, so its inverse is
concave), and ``≈ x − 1`` far beyond capacity: the old hinge ``max(0, x − 1)`` is its asymptote, so
the term keeps its unit (one capacity of lost bandwidth per second costs the weight). For the planner
and the MILP it is the chord interpolation of ``lost`` at :data:`BREAKPOINTS` — convex piecewise
linear, so the MILP writes it exactly as ``t ≥ a_k × x + b_k`` per segment — continued beyond the last
breakpoint with the asymptote's slope 1. The model's slowdown of memory-bound work in a domain at
offered load ``x`` is ``x / (x − lost(x))`` with this same piecewise-linear ``lost``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LINEAR = 0.50  # latency rise per unit of utilisation (the fit above)
POLE = 8.3e-4  # weight of the queueing pole ρ / (1 − ρ) (the fit above)
# Offered loads (capacities) where the piecewise-linear cost meets the curve: dense where the curve bends.
BREAKPOINTS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5,
               3.0, 4.0)


def latency_factor(rho: np.ndarray | float) -> np.ndarray:
    """q(ρ): loaded latency over idle latency at utilisation ρ ∈ [0, 1)."""
    r = np.asarray(rho, dtype=np.float64)
    return 1.0 + LINEAR * r + POLE * r / (1.0 - r)


def achieved(x: np.ndarray | float) -> np.ndarray:
    """ρ(x): the utilisation a domain settles at under offered load ``x`` (solves ``x = ρ q(ρ)``)."""
    x = np.asarray(x, dtype=np.float64)
    lo, hi = np.zeros_like(x), np.full_like(x, 1.0 - 1e-15)
    for _ in range(80):  # ρ q(ρ) is increasing on [0, 1): bisection
        mid = 0.5 * (lo + hi)
        low = mid * latency_factor(mid) < x
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    return 0.5 * (lo + hi)


def lost(x: np.ndarray | float) -> np.ndarray:
    """The exact curve ``x − ρ(x)`` (capacities of bandwidth lost to queueing)."""
    x = np.asarray(x, dtype=np.float64)
    return x - achieved(x)


@dataclass(frozen=True)
class ConvexPwl:
    """``f(x) = max(0, max_k slopes[k] × x + intercepts[k])``: a convex piecewise-linear function."""

    slopes: tuple[float, ...]
    intercepts: tuple[float, ...]

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        a = np.asarray(self.slopes)
        b = np.asarray(self.intercepts)
        return np.maximum(0.0, (x[..., None] * a + b).max(axis=-1))

    @classmethod
    def chords(cls, f, points: tuple[float, ...], tail_slope: float) -> ConvexPwl:
        """The chord interpolation of a convex ``f`` at ``points``, then ``tail_slope`` beyond the last."""
        xs = np.asarray(points, dtype=np.float64)
        ys = np.asarray(f(xs), dtype=np.float64)
        slopes = list(np.diff(ys) / np.diff(xs)) + [tail_slope]
        if any(b < a - 1e-12 for a, b in zip(slopes, slopes[1:], strict=False)):
            raise ValueError("chords of a non-convex function")
        starts = list(xs[:-1]) + [xs[-1]]
        y0 = list(ys[:-1]) + [ys[-1]]
        intercepts = tuple(float(y - s * x) for s, x, y in zip(slopes, starts, y0, strict=True))
        return cls(tuple(float(s) for s in slopes), intercepts)


HINGE = ConvexPwl((1.0,), (-1.0,))  # max(0, x − 1): demand beyond capacity (cache and CPU terms)
QUEUEING = ConvexPwl.chords(lost, BREAKPOINTS, 1.0)  # the bandwidth term


def slowdown_factor(x: np.ndarray | float, curve: ConvexPwl = QUEUEING) -> np.ndarray:
    """The model's time factor of memory-bound work in a domain at offered load ``x``:
    ``x / (x − curve(x))`` (at ``x = 0`` its limit, ``1 / (1 − slope)`` of the segment through 0)."""
    x = np.asarray(x, dtype=np.float64)
    at_zero = [a for a, b in zip(curve.slopes, curve.intercepts, strict=True) if abs(b) < 1e-15]  # lines through 0
    first = 1.0 / (1.0 - max(at_zero, default=0.0))
    safe = np.where(x > 0, x, 1.0)
    return np.where(x > 0, safe / np.maximum(safe - curve(safe), 1e-12), first)
