"""``cri-resmgr rebalance --calibrate``: the memory-bandwidth term against a measurement on this machine.

The interference this machine can produce for real is memory-bandwidth contention: a *hog* streaming
arrays far larger than the caches on one core, beside a memory-bound *probe* (a streaming read of
another such array) on another core. Every worker is a separate process pinned to its CPU
(``sched_setaffinity``) that allocates its arrays once and then streams in time slices it is told to
run; each slice reports bytes over the worker's own CPU time (``CLOCK_THREAD_CPUTIME_ID``), so time
the scheduler gives to other processes on that CPU is not counted as a slowdown. Short slices of the
seven phases alternate, round after round (the probe's three phases next to each other, alone in turn
first and last), so that drifts of the machine fall on all of them alike:

1. **probe alone** — its bandwidth ``B_p``;
2. **hog alone** — ``B_h``;
3. **throttled hog alone** — the same hog streaming :data:`THROTTLE_DUTY` of its time (a chunk, then
   spinning on the clock without touching memory for as long again): ``B_t``, another offered load;
4. **first hog alone** — the peak phase's hog on the probe's CPU (the same kernel as the probe, its
   own array): ``B_0``;
5. **peak** — a hog on one CPU of each core of the probe's NUMA node, at most :data:`PEAK_WORKERS`
   (the probe's and the hog's CPUs first): their total ``P``;
6. **probe beside hog** — the hog's slice starts before and ends after the probe's; the probe's
   bandwidth ``B_p'``. A round's slowdown is ``B_p / B_p' − 1`` (the probe-alone slice of that round);
7. **probe beside throttled hog** — the same with the hog of phase 3: a round's slowdown ``B_p / B_p'' − 1``.

**What is fitted, and what is checked.** The bandwidth term's curve (:mod:`.bandwidth_curve`) has its
shape from a published loaded-latency run and one parameter per domain: the capacity ``C``. It is
*fitted* to phases 2, 4 and 5 only: the capacity at which the curve makes the peak phase's streams —
each drawing alone what it was measured to draw alone (``B_0`` and ``B_h``; with more than two cores the
further hogs count as ``B_h``) — lose together what they lost (the median over the rounds of each round's
``1 − P / (B_0 + B_h + …)``, paired within the round like the slowdowns; :func:`fit_capacity`; a
closed-loop stream's rate is its demand over the latency factor, :func:`together`). The fitted ``C``
then *predicts* the probe's
slowdown beside the hog (phase 6, offered load ``(B_p + B_h) / C``) and beside the throttled hog (phase
7, ``(B_p + B_t) / C``)::

    predicted = q(ρ_beside) / q(B_p / C) − 1     (q: the curve's latency factor; ρ_beside from together())

Neither beside phase enters the fit or a prediction. On a machine with more than two cores the peak
phase runs more streams than the pair, so phase 6 is another operating point; with two cores the peak
phase *is* two streams on the probe's and the hog's CPUs, so phase 6 repeats the fit's operating point
(a different phase and a different process on the probe's CPU, but the same load) and only phase 7 is a
point the fit did not see. (Why measure ``B_0`` rather than take ``B_p`` for it: the fit rests on the
peak phase's loss, 1–2 % of the pair's alone total on a node like this one, and one stream's alone rate
off by 1 % would move it by half.) The verdict needs both within ±25 %; each check also says whether
the prediction lies in the measured slowdown's 95 % interval. For comparison each gives the
prediction with ``C = P`` (the former reading of the capacity: "the peak a saturating streaming
workload reaches") and the former hinge's ``max(0, (B_p + hog) / P − 1)``. ``peak_utilisation = P / C``
says how close the peak phase came to the fitted capacity: far below 1 when the calibration's cores cannot
saturate the memory.

The fit uses the exact curve (:func:`.bandwidth_curve.latency_factor`), of which the planner's
piecewise-linear term is the chord interpolation: at the small offered loads of a node whose cores draw
a few per cent of its memory's capacity, the chords (0.05 capacities apart) would make the slowdown a
step function.

**Clean rounds.** A round counts only if nothing else took more than :data:`MAX_DISTURBANCE` of any of
its phases (:class:`Disturbance`): every *loader* — the hog beside the probe, each hog of the peak
phase — ran for the rest of its slice's wall time (a hog kept off its CPU did not load memory), the
calibration's CPUs that a phase leaves idle ran nothing else (``/proc/stat``: another process beside
an "alone" worker may be a hog nobody measured), and the hog's slice covered the probe's. A worker's
own lost time is no disturbance: its bandwidth is over its own CPU time, which also excludes the
hypervisor's steal. Everything is computed over the clean rounds only — the measurements, the fit and
the predictions, so all come from the same moments of the machine. With fewer than
:data:`MIN_CLEAN_ROUNDS` clean rounds there is no measured figure: the report says "not enough clean
rounds" (and the command exits 1) rather than print a number it cannot trust. Rounds go on until
``--seconds`` of each phase were measured in clean rounds (60 rounds of 0.2 s by default), or four
times as many rounds were run, or :data:`MAX_SECONDS` passed: the stopping rule looks at how many
rounds were clean and at the clock, never at the figures.

**Estimators.** A measured slowdown is the median of the clean rounds' paired ratios, with a
distribution-free 95 % interval (order statistics of the median, :func:`median_interval`); the 20 %
trimmed mean is given beside it. The fit's inputs ``B_0``, ``B_h``, ``P``, and ``B_p``, ``B_t`` are
medians over the same rounds; the fitted capacity's and the predictions' intervals are the same
order-statistic interval over each clean round's own fit and predictions.

**The hog's kernel** (``hog="read"``, the default) is the probe's own: a streaming read, so ``B_p``,
``B_h`` and ``C`` are all bytes read from memory — the one unit the model's offered load adds up. A
``"copy"`` hog (numpy copy, counted as bytes read plus bytes written) also moves read-for-ownership
traffic that it does not count: glibc copies 4 MiB chunks with ordinary stores below
``glibc.cpu.x86_non_temporal_threshold`` (192 MiB here), so each written line is first read. Its
``B_h`` and ``C`` then undercount the traffic by up to a third, against the probe's exact count.

Sizes: 256 MiB per array by default, beyond any L3 this project targets (the largest fixture has 105 MiB
per socket), so every pass goes to memory. What a node's L3 holds for one VM may differ from what it
reports: an Intel Xeon VM slice that reports a 480 MiB L3 streams 22.7 GB/s from a 64 MiB array and
15–16 GB/s from 128 MiB to 2 GiB alike (one core, ``/tmp/calib_bound.py`` in docs/rebalancer.md): there
256 MiB is memory, 64 MiB is not (two 64 MiB streams then contend for the L3, not for memory).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..topology import Topology
from .bandwidth_curve import QUEUEING, achieved, latency_factor

MIB = 2**20
TOLERANCE = 0.25  # the target: predicted within ±25 % of measured
CHUNK_BYTES = 4 * MIB  # a worker checks the clock after each chunk: slices end within ~1 ms
SLICE_SECONDS = 0.2  # longest slice; a phase of --seconds is split into rounds of this at most
MIN_ROUNDS = 3
MAX_ROUNDS_FACTOR = 4  # at most this many times the wanted rounds, clean or not
MAX_SECONDS = 150.0  # and no new round after this long (a busy machine: the run says so, within minutes)
MIN_CLEAN_ROUNDS = 15  # fewer clean rounds: no measured figure (the 95 % interval of a median needs ≥ 6)
CONFIDENCE = 0.95
TRIM = 0.2  # the trimmed mean drops this share of the rounds at each end
PEAK_WORKERS = 8  # at most this many hogs in the peak phase (memory: one or two arrays each)
LEAD_SECONDS = 0.03  # the hog starts this much before the probe's slice and ends as much after it
START_SECONDS = 0.02  # slices start this long after they are sent (every worker has its line by then)
# A round counts only if nothing else took more than this share of any of its slices (see Disturbance).
MAX_DISTURBANCE = 0.1
HOG_KINDS = ("read", "copy")
# The second operating point: the hog streams this share of its time (a chunk, then as long again spinning on
# the clock without touching memory), so it offers about half its load.
THROTTLE_DUTY = 0.5
# What streams on the probe's CPU in the peak phase: a hog process of its own (the design), or the probe's own
# process ("probe": an experiment — on two cores it makes the peak phase the full-hog check's load and process).
PEAK_FIRST = ("hog", "probe")
FIT_MAX_RATIO = 1e4  # the fitted capacity is sought up to this many times the peak phase's total


@dataclass(frozen=True)
class SliceResult:
    role: str
    cpu: int
    bytes: int
    cpu_seconds: float
    wall_seconds: float
    cpus_allowed: list[int]  # the worker's affinity while it ran: its CPU only
    start: float = 0.0  # time.time() when streaming began
    end: float = 0.0  # and ended
    duty: float = 1.0  # the share of its time the worker streamed (the rest: spinning on the clock)

    @property
    def bytes_per_second(self) -> float:
        """Bytes over the worker's own CPU time."""
        return self.bytes / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    @property
    def cpu_share(self) -> float:
        return self.cpu_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


class Worker:
    """The body of one worker process: pin, allocate, then stream for each slice it is sent."""

    def __init__(self, role: str, cpu: int, mib: int, kind: str = "read"):
        if role not in ("probe", "hog"):
            raise ValueError(f"unknown role {role!r}")
        if kind not in HOG_KINDS or (role == "probe" and kind != "read"):
            raise ValueError(f"unknown kernel {kind!r} for a {role}")
        os.sched_setaffinity(0, {cpu})
        self.role, self.cpu = role, cpu
        n = mib * MIB // 8
        self.src = np.ones(n, dtype=np.float64)
        self.dst = np.empty_like(self.src) if kind == "copy" else None
        self.chunk = max(1, min(n, CHUNK_BYTES // 8))
        self.src.sum()  # fault the pages in before timing
        if self.dst is not None:
            np.copyto(self.dst, self.src)
        self.offset = 0

    def run(self, start: float, end: float, duty: float = 1.0) -> SliceResult:
        """Stream from wall-clock time ``start`` until ``end`` (``time.time()``); with ``duty`` < 1, after each
        chunk spin on the clock (no memory traffic) for ``(1 − duty) / duty`` of the chunk's time."""
        if not 0.0 < duty <= 1.0:
            raise ValueError("duty must be in (0, 1]")
        while time.time() < start:
            pass
        moved = 0
        w0, c0, t0 = time.time(), time.thread_time(), time.perf_counter()
        n, k = len(self.src), self.chunk
        while time.time() < end:
            o, t_chunk = self.offset, time.perf_counter()
            if self.dst is not None:  # copy: read one array, write the other
                np.copyto(self.dst[o:o + k], self.src[o:o + k])
                moved += 2 * 8 * min(k, n - o)
            else:  # read only
                self.src[o:o + k].sum()
                moved += 8 * min(k, n - o)
            self.offset = o + k if o + k < n else 0
            if duty < 1.0:
                now = time.perf_counter()
                until = now + (now - t_chunk) * (1.0 - duty) / duty
                while time.perf_counter() < until:
                    pass
        c1, t1, w1 = time.thread_time(), time.perf_counter(), time.time()
        return SliceResult(self.role, self.cpu, moved, c1 - c0, t1 - t0, sorted(os.sched_getaffinity(0)), w0, w1,
                           duty)


def serve(role: str, cpu: int, mib: int, kind: str = "read", stdin=sys.stdin, stdout=sys.stdout) -> None:
    """Worker protocol: "ready" once allocated, then for each line "start end [duty]" one JSON slice result."""
    w = Worker(role, cpu, mib, kind)
    print("ready", file=stdout, flush=True)
    for line in stdin:
        start, end, *duty = (float(v) for v in line.split())
        print(json.dumps(asdict(w.run(start, end, *duty))), file=stdout, flush=True)


class CalibrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class CpuTicks:
    busy: int  # user + nice + system + irq + softirq: something ran (not steal, idle or iowait)
    steal: int  # the hypervisor ran something else while this vCPU wanted to run


def parse_cpu_ticks(text: str) -> dict[int, CpuTicks]:
    """Per-CPU lines of ``/proc/stat`` (Documentation/filesystems/proc.rst, "Miscellaneous kernel statistics
    in /proc/stat": ``cpuN user nice system idle iowait irq softirq steal ...`` in USER_HZ ticks; ``guest``
    time is already inside ``user`` and ``nice``). Short or malformed lines are skipped."""
    out: dict[int, CpuTicks] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu") or parts[0] == "cpu" or len(parts) < 9:
            continue
        try:
            cpu = int(parts[0][3:])
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[1:9])
        except ValueError:
            continue
        out[cpu] = CpuTicks(user + nice + system + irq + softirq, steal)
    return out


@dataclass(frozen=True)
class Disturbance:
    """What else happened during one phase, as shares of the phase's wall time.

    Only what changes the figures counts. A worker's own lost CPU time does not: its bandwidth is over
    its own CPU time, and that excludes steal too (``CLOCK_THREAD_CPUTIME_ID`` runs on the scheduler's
    task clock, from which paravirtual steal time is subtracted — kernel/sched/core.c,
    update_rq_clock_task; measured here: wall − thread time − run delay equals ``/proc/stat`` steal within
    a tick). What counts is a *loader* — the hog beside the probe, every hog of the peak phase — that
    did not run (the probe then ran beside less load than the phase says), a calibration CPU that should
    have been idle running something else (another process beside an "alone" worker may be a hog nobody
    measured), and a hog that did not cover the probe's slice."""

    loader_share_lost: float = 0.0  # 1 − the least CPU time over wall time of the phase's loaders
    foreign_share: float = 0.0  # the largest busy time of a calibration CPU the phase left idle
    steal_share: float = 0.0  # the largest steal of a CPU the phase ran on (reported; inside the above)
    hog_covered_probe: bool = True  # the hog streamed before and after the probe's slice (beside phase)

    @property
    def share(self) -> float:
        return max(self.loader_share_lost, self.foreign_share, 0.0 if self.hog_covered_probe else 1.0)

    @classmethod
    def worst(cls, ds: Sequence[Disturbance]) -> Disturbance:
        return cls(max(d.loader_share_lost for d in ds), max(d.foreign_share for d in ds),
                   max(d.steal_share for d in ds), all(d.hog_covered_probe for d in ds))


def disturbance(results: Sequence[SliceResult], loaders: Sequence[int], before: dict[int, CpuTicks],
                after: dict[int, CpuTicks], seconds: float, hz: float, idle_cpus: Sequence[int]) -> Disturbance:
    """The :class:`Disturbance` of one phase from its workers' slices (``loaders``: the indexes of those whose
    running the phase assumes) and ``/proc/stat`` around it (``seconds`` of wall time between the two
    reads, ``hz`` ticks a second)."""
    def share(cpu: int, attr: str) -> float:
        if cpu not in before or cpu not in after or seconds <= 0:
            return 0.0
        return (getattr(after[cpu], attr) - getattr(before[cpu], attr)) / (hz * seconds)

    lost = 1.0 - min((results[i].cpu_share for i in loaders), default=1.0)
    foreign = max((share(c, "busy") for c in idle_cpus), default=0.0)
    steal = max((share(r.cpu, "steal") for r in results), default=0.0)
    return Disturbance(max(0.0, lost), max(0.0, foreign), max(0.0, steal))


@dataclass(frozen=True)
class Round:
    probe_alone_bytes_per_second: float
    hog_alone_bytes_per_second: float
    peak_bytes_per_second: float
    probe_beside_hog_bytes_per_second: float
    hog_beside_probe_bytes_per_second: float
    throttled_hog_alone_bytes_per_second: float  # the hog at THROTTLE_DUTY, alone
    probe_beside_throttled_hog_bytes_per_second: float
    throttled_hog_beside_probe_bytes_per_second: float
    first_hog_alone_bytes_per_second: float  # the peak phase's hog on the probe's CPU, alone
    disturbance: Disturbance = field(default_factory=Disturbance)  # the worst over the round's phases

    @property
    def slowdown(self) -> float:
        return self.probe_alone_bytes_per_second / self.probe_beside_hog_bytes_per_second - 1.0

    @property
    def throttled_slowdown(self) -> float:
        return self.probe_alone_bytes_per_second / self.probe_beside_throttled_hog_bytes_per_second - 1.0

    def peak_alone(self, workers: int, peak_first: str = "hog") -> list[float]:
        """What each of the peak phase's ``workers`` streams draws alone: the stream on the probe's CPU (the first
        hog, or the probe with ``peak_first="probe"``) and the hog on the hog's CPU as measured alone; any further
        one (more than two cores) as the hog alone."""
        first = self.probe_alone_bytes_per_second if peak_first == "probe" else self.first_hog_alone_bytes_per_second
        return [first] + [self.hog_alone_bytes_per_second] * (workers - 1)

    @property
    def clean(self) -> bool:
        return self.disturbance.share <= MAX_DISTURBANCE


@dataclass(frozen=True)
class Validation:
    """One operating point the fit did not see: the probe beside a hog, measured against predicted."""

    hog_alone_bytes_per_second: float  # what the hog draws alone at this point (its offered load)
    probe_beside_bytes_per_second: float
    hog_beside_bytes_per_second: float
    measured_slowdown: float  # median over the clean rounds of the probe's slowdown within the round
    measured_slowdown_interval: tuple[float, float]  # its distribution-free 95 % interval
    measured_slowdown_trimmed_mean: float  # the 20 % trimmed mean of the same ratios
    offered_load: float | None  # (B_p + hog) / fitted capacity (None: no capacity could be fitted)
    predicted_slowdown: float  # the curve at the fitted capacity; nothing of this point's beside phase
    predicted_slowdown_interval: tuple[float, float]  # 95 % interval of the rounds' own predictions
    error: float  # predicted − measured (fractions of the probe's time alone)
    relative_error: float | None  # |predicted − measured| / measured
    within_tolerance: bool
    predicted_inside_measured_interval: bool  # the prediction lies in the measured slowdown's 95 % interval
    predicted_slowdown_capacity_is_peak: float  # the curve with C = the peak phase's total (the former reading)
    hinge_predicted_slowdown: float  # the former hinge with C = the peak: max(0, (B_p + hog) / peak − 1)


@dataclass(frozen=True)
class PairFit:
    """The other split of the same rounds: the capacity fitted to the probe's measured slowdown beside the full
    hog (phase 6) instead of the peak, checked at the throttled point (phase 7) only. Reported beside the
    verdict, which stays on the peak fit: this split was added after the peak fit's results were seen."""

    fitted_capacity_bytes_per_second: float | None
    throttled_predicted_slowdown: float
    throttled_error: float
    throttled_relative_error: float | None
    throttled_within_tolerance: bool
    throttled_predicted_inside_measured_interval: bool


@dataclass(frozen=True)
class Calibration:
    cpus: tuple[int, int]  # probe, hog
    peak_cpus: list[int]
    array_mib: int
    hog: str  # the hog's kernel: "read" (the probe's) or "copy"
    throttle_duty: float  # the throttled hog streams this share of its time
    peak_first: str  # what streams on the probe's CPU in the peak phase: "hog" (its own process) or "probe"
    rounds: list[Round]
    clean_rounds: list[int]  # indexes of the rounds everything below is computed from
    slice_seconds: float
    verdict: str  # "within ±25 %", "outside ±25 %", "no loss to fit ..." or "not enough clean rounds: ..."
    # Measured (medians over the clean rounds); the fit uses these alone-phase and peak-phase figures only:
    probe_alone_bytes_per_second: float | None
    hog_alone_bytes_per_second: float | None
    first_hog_alone_bytes_per_second: float | None  # the peak phase's hog on the probe's CPU, alone
    peak_bytes_per_second: float | None  # the peak phase's total: what its streams delivered together
    peak_lost_share: float | None  # median over the rounds of 1 − peak / Σ what its streams drew alone
    # The fit: the capacity at which the curve makes the peak phase's streams deliver what they delivered.
    fitted_capacity_bytes_per_second: float | None
    fitted_capacity_interval: tuple[float, float] | None  # 95 % interval of the rounds' own fits (inf: no loss)
    peak_utilisation: float | None  # peak / fitted capacity: how close the peak phase came to saturation
    # The checks, each at an operating point whose beside phase the fit did not use:
    full: Validation | None  # probe beside the hog streaming all the time
    throttled: Validation | None  # probe beside the hog at throttle_duty: another offered load
    within_tolerance: bool | None  # both within ±25 %
    pair_fit: PairFit | None  # the capacity fitted to phase 6 instead, checked at phase 7 (not the verdict)
    memory_bandwidth_cost_per_second: float | None  # the term's cost of probe + hog at the fitted capacity

    @property
    def conclusive(self) -> bool:
        return self.full is not None

    def as_dict(self) -> dict:
        return asdict(self)


def together(alone: Sequence[float], capacity: float) -> tuple[float, float]:
    """(total delivered, latency factor) of streams sharing a domain of ``capacity``, each drawing ``alone[i]``
    when alone, on the curve. A closed-loop stream's rate is its demand over the latency factor: alone at
    ρ = B / C it drew ``B``, so its demand is ``B × q(B / C)``; together the domain settles where
    ``ρ q(ρ) = Σ demand / C`` (:func:`.bandwidth_curve.achieved`) and delivers ``C ρ``."""
    if capacity <= max(alone):
        raise ValueError("a capacity must exceed what one stream draws alone")
    demand = sum(float(b * latency_factor(b / capacity)) for b in alone)
    rho = float(achieved(demand / capacity))
    return capacity * rho, float(latency_factor(rho))


def predict(probe: float, hog: float, capacity: float | None) -> float:
    """The curve's slowdown of a probe drawing ``probe`` alone beside a hog drawing ``hog`` alone, in a domain
    of ``capacity`` (None: no measurable loss, no slowdown)."""
    if capacity is None:
        return 0.0
    _, beside = together([probe, hog], capacity)
    return beside / float(latency_factor(probe / capacity)) - 1.0


def fit_capacity(alone: Sequence[float], delivered: float) -> float | None:
    """The capacity at which the curve makes streams drawing ``alone`` each deliver ``delivered`` together
    (:func:`together`; the delivered total grows with the capacity, so bisection). None when they lost
    nothing measurable: no capacity below ``FIT_MAX_RATIO`` × the delivered total reproduces so little loss."""
    lo, hi = max(delivered, max(alone)) * (1 + 1e-9), delivered * FIT_MAX_RATIO
    if delivered >= sum(alone) or together(alone, hi)[0] < delivered:
        return None
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if together(alone, mid)[0] < delivered else (lo, mid)
        if hi / lo < 1 + 1e-12:
            break
    return math.sqrt(lo * hi)


def fit_capacity_to_slowdown(probe: float, hog: float, slowdown: float) -> float | None:
    """The capacity at which the curve predicts ``slowdown`` for the probe beside the hog (:func:`predict`
    falls as the capacity grows, so bisection); None when the slowdown is too small for any capacity below
    ``FIT_MAX_RATIO`` × their total."""
    lo, hi = max(probe, hog) * (1 + 1e-9), (probe + hog) * FIT_MAX_RATIO
    if slowdown <= predict(probe, hog, hi):
        return None
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if predict(probe, hog, mid) > slowdown else (lo, mid)
        if hi / lo < 1 + 1e-12:
            break
    return math.sqrt(lo * hi)


def _pair_fit(bp: float, full: Validation, throttled: Validation) -> PairFit:
    cap = fit_capacity_to_slowdown(bp, full.hog_alone_bytes_per_second, full.measured_slowdown)
    predicted = predict(bp, throttled.hog_alone_bytes_per_second, cap)
    measured = throttled.measured_slowdown
    lo, hi = throttled.measured_slowdown_interval
    err = predicted - measured
    return PairFit(cap, predicted, err, abs(err) / abs(measured) if measured else None,
                   abs(err) <= TOLERANCE * abs(measured), lo <= predicted <= hi)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics ``x_(k)``, ``x_(n+1−k)`` with the
    largest ``k`` such that ``2 P(Binomial(n, ½) < k) ≤ 1 − confidence`` (the sign-test interval, e.g.
    Hollander & Wolfe, *Nonparametric Statistical Methods*, §3.6). With too few values for that
    confidence (n < 6 at 95 %) it is the whole range."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    k, tail = 0, 0.0
    while k < n // 2:
        tail += math.comb(n, k) / 2.0**n  # P(B ≤ k)
        if 2 * tail > 1.0 - confidence:
            break
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    xs = sorted(values)
    cut = int(len(xs) * trim)
    kept = xs[cut:len(xs) - cut] or xs
    return float(np.mean(kept))


def _validation(used: list[Round], capacity: float | None, round_capacities: list[float | None], bp: float,
                peak: float, hog: str) -> Validation:
    """The check at one operating point: ``hog`` is ``""`` (the full hog) or ``"throttled_"``."""
    def med(attr: str) -> float:
        return float(np.median([getattr(r, attr) for r in used]))

    bh = med(f"{hog}hog_alone_bytes_per_second")
    beside = med(f"probe_beside_{hog}hog_bytes_per_second")
    if min(bh, beside) <= 0:
        raise CalibrationError("a phase moved no bytes")
    ratios = [r.throttled_slowdown if hog else r.slowdown for r in used]
    measured = float(np.median(ratios))
    lo, hi = median_interval(ratios)
    predicted = predict(bp, bh, capacity)
    per_round = [predict(r.probe_alone_bytes_per_second, getattr(r, f"{hog}hog_alone_bytes_per_second"), c)
                 for r, c in zip(used, round_capacities, strict=True)]
    err = predicted - measured
    return Validation(
        hog_alone_bytes_per_second=bh, probe_beside_bytes_per_second=beside,
        hog_beside_bytes_per_second=med(f"{hog}hog_beside_probe_bytes_per_second"),
        measured_slowdown=measured, measured_slowdown_interval=(lo, hi),
        measured_slowdown_trimmed_mean=trimmed_mean(ratios),
        offered_load=(bp + bh) / capacity if capacity else None,
        predicted_slowdown=predicted, predicted_slowdown_interval=median_interval(per_round),
        error=err, relative_error=abs(err) / abs(measured) if measured else None,
        within_tolerance=abs(err) <= TOLERANCE * abs(measured),
        predicted_inside_measured_interval=lo <= predicted <= hi,
        predicted_slowdown_capacity_is_peak=predict(bp, bh, peak) if peak > max(bp, bh) else math.inf,
        hinge_predicted_slowdown=max(0.0, (bp + bh) / peak - 1.0))


def summarise(cpus: tuple[int, int], peak_cpus: list[int], mib: int, rounds: list[Round], slice_seconds: float,
              weight: float, hog: str = "read", min_clean: int = MIN_CLEAN_ROUNDS,
              duty: float = THROTTLE_DUTY, peak_first: str = "hog") -> Calibration:
    """The report from measured rounds: pure arithmetic (tested without running anything). The capacity is
    fitted to the alone and peak phases only; each prediction uses that capacity and the alone phases, never
    the beside phase it is checked against."""
    if not rounds:
        raise CalibrationError("no rounds measured")
    clean = [i for i, r in enumerate(rounds) if r.clean]
    used = [rounds[i] for i in clean]
    base: dict[str, Any] = dict(cpus=cpus, peak_cpus=peak_cpus, array_mib=mib, hog=hog, throttle_duty=duty,
                                peak_first=peak_first, rounds=rounds, clean_rounds=clean, slice_seconds=slice_seconds)
    if len(used) < min_clean:
        return Calibration(
            **base, verdict=f"not enough clean rounds: {len(used)} of {len(rounds)} (need {min_clean})",
            probe_alone_bytes_per_second=None, hog_alone_bytes_per_second=None,
            first_hog_alone_bytes_per_second=None, peak_bytes_per_second=None,
            peak_lost_share=None, fitted_capacity_bytes_per_second=None, fitted_capacity_interval=None,
            peak_utilisation=None, full=None, throttled=None, within_tolerance=None, pair_fit=None,
            memory_bandwidth_cost_per_second=None)

    def med(attr: str) -> float:
        return float(np.median([getattr(r, attr) for r in used]))

    n = len(peak_cpus)
    bp, bh, peak = med("probe_alone_bytes_per_second"), med("hog_alone_bytes_per_second"), med("peak_bytes_per_second")
    first = bp if peak_first == "probe" else med("first_hog_alone_bytes_per_second")
    if min(bp, bh, peak, first) <= 0:
        raise CalibrationError("a phase moved no bytes")
    alone = [first] + [bh] * (n - 1)
    # The loss is taken within each round (its peak against its own alone phases), like the slowdowns: the
    # median of paired ratios, not a ratio of medians, which drifts of the machine between rounds would bias.
    lost = float(np.median([1.0 - r.peak_bytes_per_second / sum(r.peak_alone(n, peak_first)) for r in used]))
    capacity = fit_capacity(alone, (1.0 - lost) * sum(alone))
    round_caps = [fit_capacity(r.peak_alone(n, peak_first), r.peak_bytes_per_second) for r in used]
    full = _validation(used, capacity, round_caps, bp, peak, "")
    throttled = _validation(used, capacity, round_caps, bp, peak, "throttled_")
    within = full.within_tolerance and throttled.within_tolerance
    verdict = f"{'within' if within else 'outside'} ±{TOLERANCE:.0%}"
    if capacity is None:
        verdict += f" (no loss to fit: the peak phase delivered {1 - lost:.3f} of what its streams draw alone)"
    return Calibration(
        **base, verdict=verdict,
        probe_alone_bytes_per_second=bp, hog_alone_bytes_per_second=bh, first_hog_alone_bytes_per_second=first,
        peak_bytes_per_second=peak,
        peak_lost_share=lost,
        fitted_capacity_bytes_per_second=capacity,
        fitted_capacity_interval=median_interval([math.inf if c is None else c for c in round_caps]),
        peak_utilisation=peak / capacity if capacity else None,
        full=full, throttled=throttled, within_tolerance=within, pair_fit=_pair_fit(bp, full, throttled),
        memory_bandwidth_cost_per_second=weight * float(QUEUEING((bp + bh) / capacity)) if capacity else 0.0,
    )


def rounds_from_report(report: dict[str, Any]) -> list[Round]:
    """The rounds of a printed report (its JSON), clean or not."""
    try:
        return [Round(**{k: float(v) for k, v in r.items() if k != "disturbance"},
                      disturbance=Disturbance(**r["disturbance"])) for r in report["rounds"]]
    except (KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f"not a calibration report: {e}") from e


POOLED_SETTINGS = ("cpus", "peak_cpus", "array_mib", "hog", "throttle_duty", "slice_seconds", "peak_first")
SETTING_DEFAULTS = {"peak_first": "hog"}  # reports written before the setting existed


def pool(reports: Sequence[dict[str, Any]], weight: float) -> Calibration:
    """One report over the rounds of several runs with the same settings (each run is held to the bench lock's
    few minutes; pooled, their clean rounds narrow the intervals). Each round stays paired within itself, and
    the fit and the predictions still use only the alone and peak phases, now of every pooled round."""
    if not reports:
        raise CalibrationError("no reports to pool")
    first = reports[0]
    for i, r in enumerate(reports[1:], 1):
        for k in POOLED_SETTINGS:
            mine, theirs = r.get(k, SETTING_DEFAULTS.get(k)), first.get(k, SETTING_DEFAULTS.get(k))
            if mine != theirs:
                raise CalibrationError(f"report {i} has {k} {mine!r}, report 0 {theirs!r}")
    rounds = [x for r in reports for x in rounds_from_report(r)]
    try:
        cpus = (int(first["cpus"][0]), int(first["cpus"][1]))
        return summarise(cpus, [int(c) for c in first["peak_cpus"]], int(first["array_mib"]), rounds,
                         float(first["slice_seconds"]), weight, str(first["hog"]), duty=float(first["throttle_duty"]),
                         peak_first=str(first.get("peak_first", "hog")))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise CalibrationError(f"not a calibration report: {e}") from e


def pick_cpus(topo: Topology) -> tuple[tuple[int, int], list[int]]:
    """(probe CPU, hog CPU) on different cores, and the CPUs of the peak phase: one per core of the
    probe's NUMA node, those two first; ValueError when there are not two cores."""
    allowed = os.sched_getaffinity(0)
    by_core: dict[tuple[int, int], int] = {}
    for c in sorted(topo.cpus.values(), key=lambda c: c.id):
        if c.id in allowed:
            by_core.setdefault((c.package, c.core), c.id)
    cpus = sorted(by_core.values())
    if len(cpus) < 2:
        raise ValueError("calibration needs two CPUs on different cores")
    node = topo.cpus[cpus[0]].numa_node
    same = [c for c in cpus if topo.cpus[c].numa_node == node]
    a, b = same[:2] if len(same) >= 2 else cpus[:2]
    peak = [a, b] + [c for c in same if c not in (a, b)]
    return (a, b), peak[:PEAK_WORKERS]


class _Proc:
    def __init__(self, role: str, cpu: int, mib: int, kind: str, timeout: float):
        args = [sys.executable, "-m", "cri_resmgr.rebalancer.calibrate", role, str(cpu), str(mib), kind]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # argv only
        self.cpu = cpu
        self.timeout = timeout
        if self._line() != "ready":
            raise CalibrationError(f"{role} worker on CPU {cpu} did not start")

    def _line(self) -> str:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            self.p.wait(timeout=self.timeout)
            raise CalibrationError(f"worker exited with status {self.p.returncode}")
        return line.strip()

    def send(self, start: float, end: float, duty: float = 1.0) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(f"{start!r} {end!r} {duty!r}\n")
        self.p.stdin.flush()

    def result(self) -> SliceResult:
        return SliceResult(**json.loads(self._line()))

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


class _Phases:
    """Runs one phase's slices on several workers at once and says what else happened meanwhile."""

    def __init__(self, proc: Path, calibration_cpus: list[int], slice_seconds: float):
        self.stat = Path(proc) / "stat"
        self.cpus = calibration_cpus
        self.slice = slice_seconds
        self.hz = float(os.sysconf("SC_CLK_TCK"))

    def _ticks(self) -> dict[int, CpuTicks]:
        try:
            return parse_cpu_ticks(self.stat.read_text())
        except OSError:
            return {}  # no foreign-load check then; the loaders' CPU-share check still holds

    def run(self, workers: list[tuple[_Proc, float, float, float]], loaders: Sequence[int] = ()) -> _Phase:
        """``workers``: (worker, start offset, end offset beyond the slice, duty); ``loaders``: see
        :func:`disturbance`."""
        before, t0 = self._ticks(), time.perf_counter()
        t = time.time() + START_SECONDS
        for w, a, b, duty in workers:
            w.send(t + a, t + self.slice + b, duty)
        results = [w.result() for w, _, _, _ in workers]
        after, seconds = self._ticks(), time.perf_counter() - t0
        active = {w.cpu for w, _, _, _ in workers}
        return _Phase(results, disturbance(results, loaders, before, after, seconds, self.hz,
                                           [c for c in self.cpus if c not in active]))


@dataclass(frozen=True)
class _Phase:
    results: list[SliceResult]
    disturbance: Disturbance


def calibrate(topo: Topology, phase_seconds: float = 12.0, mib: int = 256, weight: float = 4.0,
              cpus: tuple[int, int] | None = None, hog: str = "read", proc: Path = Path("/proc"),
              slice_seconds: float = SLICE_SECONDS, max_rounds_factor: int = MAX_ROUNDS_FACTOR,
              max_seconds: float = MAX_SECONDS, duty: float = THROTTLE_DUTY, peak_first: str = "hog") -> Calibration:
    """Rounds until ``phase_seconds`` of each phase were measured in clean rounds (``phase_seconds /
    slice_seconds`` of them), or ``max_rounds_factor`` times as many rounds were run, or ``max_seconds``
    have passed. The stopping rule looks only at how many rounds were clean and at the clock, never at
    the rounds' figures."""
    if hog not in HOG_KINDS:
        raise ValueError(f"hog must be one of {', '.join(HOG_KINDS)}")
    if peak_first not in PEAK_FIRST:
        raise ValueError(f"peak_first must be one of {', '.join(PEAK_FIRST)}")
    (a, b), peak = pick_cpus(topo)
    if cpus is not None:
        a, b = cpus
        peak = [a, b] + [c for c in peak if c not in (a, b)]
    wanted = max(MIN_ROUNDS, math.ceil(phase_seconds / slice_seconds))
    sl = phase_seconds / wanted
    timeout = 60.0 + 10 * sl
    procs: list[_Proc] = []
    phases = _Phases(proc, peak, sl)
    rounds: list[Round] = []
    try:
        probe = _Proc("probe", a, mib, "read", timeout)
        procs.append(probe)
        hogs = []
        for c in peak:
            hogs.append(_Proc("hog", c, mib, hog, timeout))
            procs.append(hogs[-1])
        hog_b = hogs[1]  # the hog on CPU b

        def probe_alone() -> _Phase:
            return phases.run([(probe, 0.0, 0.0, 1.0)])

        def hog_alone(hog_duty: float = 1.0) -> _Phase:
            return phases.run([(hog_b, 0.0, 0.0, hog_duty)])

        def first_hog_alone() -> _Phase:
            return phases.run([(hogs[0], 0.0, 0.0, 1.0)])

        peak_workers = [probe] + hogs[1:] if peak_first == "probe" else hogs

        def peak_phase() -> _Phase:
            return phases.run([(h, 0.0, 0.0, 1.0) for h in peak_workers], loaders=range(len(peak_workers)))

        def beside(hog_duty: float = 1.0) -> _Phase:
            ph = phases.run([(hog_b, 0.0, 2 * LEAD_SECONDS, hog_duty), (probe, LEAD_SECONDS, 0.0, 1.0)], loaders=[0])
            hb, pb = ph.results
            d = ph.disturbance
            return _Phase(ph.results, Disturbance(d.loader_share_lost, d.foreign_share, d.steal_share,
                                                  hb.start <= pb.start and hb.end >= pb.end))

        deadline = time.monotonic() + max_seconds
        while (sum(r.clean for r in rounds) < wanted and len(rounds) < max_rounds_factor * wanted
               and time.monotonic() < deadline):
            # The probe's three phases next to each other, alone in turn first and last; then the others.
            if len(rounds) % 2 == 0:
                pa, pb, pt = probe_alone(), beside(), beside(duty)
                ha, ht, h0, pk = hog_alone(), hog_alone(duty), first_hog_alone(), peak_phase()
            else:
                pt, pb, pa = beside(duty), beside(), probe_alone()
                pk, h0, ht, ha = peak_phase(), first_hog_alone(), hog_alone(duty), hog_alone()
            rounds.append(Round(pa.results[0].bytes_per_second, ha.results[0].bytes_per_second,
                                sum(r.bytes_per_second for r in pk.results), pb.results[1].bytes_per_second,
                                pb.results[0].bytes_per_second, ht.results[0].bytes_per_second,
                                pt.results[1].bytes_per_second, pt.results[0].bytes_per_second,
                                h0.results[0].bytes_per_second,
                                Disturbance.worst([p.disturbance for p in (pa, pb, pt, ha, ht, h0, pk)])))
    finally:
        for p in procs:
            p.close()
    return summarise((a, b), peak, mib, rounds, sl, weight, hog, duty=duty, peak_first=peak_first)


def _main(argv: list[str]) -> int:
    if len(argv) not in (3, 4) or argv[0] not in ("probe", "hog"):
        print("usage: python -m cri_resmgr.rebalancer.calibrate probe|hog CPU MIB [read|copy]", file=sys.stderr)
        return 2
    serve(argv[0], int(argv[1]), int(argv[2]), argv[3] if len(argv) == 4 else "read")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
