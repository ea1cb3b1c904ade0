"""``cri-resmgr rebalance --calibrate``: the memory-bandwidth term against a measurement on this machine.

The interference this machine can produce for real is memory-bandwidth contention: a *hog* streaming
arrays far larger than the caches on one core, beside a memory-bound *probe* (a streaming read of
another such array) on another core. Every worker is a separate process pinned to its CPU
(``sched_setaffinity``) that allocates its arrays once and then streams in time slices it is told to
run; each slice reports bytes over the worker's own CPU time (``CLOCK_THREAD_CPUTIME_ID``), so time
the scheduler gives to other processes on that CPU is not counted as a slowdown. Every calibration CPU a
phase streams nothing on runs a *spinner* (that CPU's hog spinning on the clock without touching memory),
so every phase has every calibration CPU busy: an "alone" phase differs from a "beside" phase in memory
traffic only, not in whether the neighbouring CPU is idle (a halted vCPU, a core's power state), and what
other processes take shows as the workers' lost time (``foreign_share``). Short slices of the nine phases
alternate, round after round (the probe's four phases next to each other, alone in turn first and last),
so that drifts of the machine fall on all of them alike:

1. **probe alone** — its bandwidth ``B_p``;
2. **hog alone** — ``B_h``;
3. **throttled hog alone** — the same hog streaming :data:`THROTTLE_DUTY` of its time (a chunk, then
   spinning on the clock without touching memory for as long again): ``B_t``, and the share of its CPU
   time it spent streaming, ``s_t`` (measured: its time in chunks over its CPU time);
4. **second throttled hog alone** — the same at :data:`SECOND_THROTTLE_DUTY`: ``B_t2``, ``s_t2``;
5. **first hog alone** — the peak phase's hog on the probe's CPU: ``B_0`` (for the peak fit only);
6. **peak** — a hog on one CPU of each core of the probe's NUMA node, at most :data:`PEAK_WORKERS`
   (the probe's and the hog's CPUs first): their total ``P`` (for the peak fit only);
7. **probe beside hog** — the hog's slice starts before and ends after the probe's; the probe's
   bandwidth ``B_p'``. A round's slowdown is ``B_p / B_p' − 1`` (the probe-alone slice of that round);
8. **probe beside throttled hog** — the same with the hog of phase 3;
9. **probe beside second throttled hog** — the same with the hog of phase 4.

**What is fitted, and what is checked.** The bandwidth term's curve (:mod:`.bandwidth_curve`) has its
shape from a published loaded-latency run and one parameter per domain: the capacity ``C``. It is
*fitted* to phase 7: the capacity at which the curve predicts the probe's measured slowdown beside the full
hog (:func:`fit_capacity_to_slowdown`; a closed-loop stream's rate is its demand over the latency factor,
:func:`together`, and the probe's slowdown is ``q(ρ_beside) / q(B_p / C) − 1``, :func:`predict`). Phases 8
and 9 are *held out*: predicted from ``C`` and the alone phases only, then compared. The model of a
throttled hog (:func:`predict_bursts`) is declared with this design, before the runs that check it: while
it streams it interferes as the full hog does (its chunks run at the full hog's pace, and what slows the
probe is the hog's traffic at that moment), while it spins not at all, so the probe's slowdown is the
time average over the share ``s_t`` of time the hog streams::

    predicted = 1 / ((1 − s_t) + s_t / (1 + predict(B_p, B_h, C))) − 1

The former reading — the throttled hog as its mean load ``B_t`` (``predict(B_p, B_t, C)``) — is reported
beside it (``predicted_slowdown_mean_load``). The verdict needs both held-out points within ±25 %; each
also says whether the prediction lies in the measured slowdown's 95 % interval.

**The peak fit** (``peak_fit``, the former design, reported beside the verdict and not it): the capacity at
which the curve makes the peak phase's streams — each drawing alone what it was measured to draw alone
(``B_0`` and ``B_h``; with more than two cores the further hogs count as ``B_h``) — lose together what they
lost (the median over the rounds of each round's ``1 − P / (B_0 + B_h + …)``; :func:`fit_capacity`), and
the three points predicted with it. The curve gives every stream in a domain the same latency factor, so
the peak phase's loss is split evenly; measured here, the probe beside the hog lost less than the peak
phase's streams did (docs/rebalancer.md), which the comparison keeps visible.

The fit uses the exact curve (:func:`.bandwidth_curve.latency_factor`), of which the planner's
piecewise-linear term is the chord interpolation: at the small offered loads of a node whose cores draw
a few per cent of its memory's capacity, the chords (0.05 capacities apart) would make the slowdown a
step function.

**Clean rounds.** A round counts only if nothing else took more than :data:`MAX_DISTURBANCE` of any of
its phases (:class:`Disturbance`): every *loader* — every worker but the one measured: the hog beside the
probe, each hog of the peak phase, the spinners — ran for the rest of its slice's wall time (a hog kept off
its CPU did not load memory; a spinner kept off its CPU means something else ran there, maybe a hog nobody
measured), and the hog's slice covered the probe's. The measured worker's own lost time is no
disturbance: its bandwidth is over its own CPU time, which also excludes the hypervisor's steal.
Everything is computed over the clean rounds only — the measurements, the fit and
the predictions, so all come from the same moments of the machine. With fewer than
:data:`MIN_CLEAN_ROUNDS` clean rounds there is no measured figure: the report says "not enough clean
rounds" (and the command exits 1) rather than print a number it cannot trust. Rounds go on until
``--seconds`` of each phase were measured in clean rounds (60 rounds of 0.2 s by default), or four
times as many rounds were run, or :data:`MAX_SECONDS` passed: the stopping rule looks at how many
rounds were clean and at the clock, never at the figures.

**Estimators.** A measured slowdown is the median of the clean rounds' paired ratios, with a
distribution-free 95 % interval (order statistics of the median, :func:`median_interval`); the 20 %
trimmed mean is given beside it. ``B_p``, ``B_h``, ``s_t``, ``s_t2`` and the peak fit's ``B_0`` and ``P`` are
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
from fractions import Fraction
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
SECOND_THROTTLE_DUTY = 0.75  # the third operating point (the second held-out one)
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
    duty: float = 1.0  # the share of its time the worker was told to stream (the rest: spinning on the clock)
    stream_seconds: float = 0.0  # wall time spent streaming chunks (the rest of the slice: spinning)

    @property
    def bytes_per_second(self) -> float:
        """Bytes over the worker's own CPU time."""
        return self.bytes / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    @property
    def cpu_share(self) -> float:
        return self.cpu_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def stream_share(self) -> float:
        """The share of its CPU time the worker spent streaming: 1 for a full hog, about its duty for a throttled one,
        0 for a spinner."""
        return min(1.0, self.stream_seconds / self.cpu_seconds) if self.cpu_seconds > 0 else 0.0


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
        chunk spin on the clock (no memory traffic) for ``(1 − duty) / duty`` of the chunk's time; with ``duty`` 0
        only spin (a *spinner*: the CPU busy, no memory traffic)."""
        if not 0.0 <= duty <= 1.0:
            raise ValueError("duty must be in [0, 1]")
        while time.time() < start:
            pass
        moved, streaming = 0, 0.0
        w0, c0, t0 = time.time(), time.thread_time(), time.perf_counter()
        n, k = len(self.src), self.chunk
        while duty == 0.0 and time.time() < end:
            pass
        while duty > 0.0 and time.time() < end:
            o, t_chunk = self.offset, time.perf_counter()
            if self.dst is not None:  # copy: read one array, write the other
                np.copyto(self.dst[o:o + k], self.src[o:o + k])
                moved += 2 * 8 * min(k, n - o)
            else:  # read only
                self.src[o:o + k].sum()
                moved += 8 * min(k, n - o)
            self.offset = o + k if o + k < n else 0
            now = time.perf_counter()
            streaming += now - t_chunk
            if duty < 1.0:
                until = now + (now - t_chunk) * (1.0 - duty) / duty
                while time.perf_counter() < until:
                    pass
        c1, t1, w1 = time.thread_time(), time.perf_counter(), time.time()
        return SliceResult(self.role, self.cpu, moved, c1 - c0, t1 - t0, sorted(os.sched_getaffinity(0)), w0, w1,
                           duty, streaming)


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
    steal: int  # the hypervisor ran something else while this vCPU wanted to run (USER_HZ ticks)


def parse_cpu_ticks(text: str) -> dict[int, CpuTicks]:
    """The steal ticks of the per-CPU lines of ``/proc/stat`` (Documentation/filesystems/proc.rst,
    "Miscellaneous kernel statistics in /proc/stat": ``cpuN user nice system idle iowait irq softirq steal ...``
    in USER_HZ ticks). Only steal: every calibration CPU runs a worker in every phase (a spinner where the phase
    streams nothing), so what other processes take shows as the workers' own lost time, not as busy ticks.
    Short or malformed lines are skipped."""
    out: dict[int, CpuTicks] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu") or parts[0] == "cpu" or len(parts) < 9:
            continue
        try:
            out[int(parts[0][3:])] = CpuTicks(int(parts[8]))
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class Disturbance:
    """What else happened during one phase, as shares of the phase's wall time.

    Every calibration CPU runs one of the calibration's pinned workers for the whole phase (a *spinner*, spinning
    on the clock without touching memory, on each CPU the phase streams nothing on), so the CPU time anything
    else took on them is each worker's lost time: wall − its own CPU time (``CLOCK_THREAD_CPUTIME_ID``). That
    is other processes and the hypervisor's steal (the task clock leaves steal out — kernel/sched/core.c,
    update_rq_clock_task; measured here: wall − thread time − run delay equals ``/proc/stat`` steal within a
    tick): ``foreign_share``, the largest over the phase's workers, reported so that a noisy run shows.

    What makes a round not count is narrower: a *loader* — every worker but the one measured (the hog beside
    the probe, the hogs of the peak phase, the spinners) — that did not run (the measured one then ran beside
    less than the phase says), or a hog that did not cover the probe's slice. The measured worker's own lost
    time is no disturbance: its bandwidth is over its own CPU time."""

    loader_share_lost: float = 0.0  # 1 − the least CPU time over wall time of the phase's loaders
    foreign_share: float = 0.0  # the largest share of the wall time any of the phase's workers lost to others
    steal_share: float = 0.0  # the largest steal (/proc/stat) of a CPU the phase ran on: part of the above
    hog_covered_probe: bool = True  # the hog streamed before and after the probe's slice (beside phase)

    @property
    def share(self) -> float:
        return max(self.loader_share_lost, 0.0 if self.hog_covered_probe else 1.0)

    @classmethod
    def worst(cls, ds: Sequence[Disturbance]) -> Disturbance:
        return cls(max(d.loader_share_lost for d in ds), max(d.foreign_share for d in ds),
                   max(d.steal_share for d in ds), all(d.hog_covered_probe for d in ds))


def disturbance(results: Sequence[SliceResult], loaders: Sequence[int], before: dict[int, CpuTicks],
                after: dict[int, CpuTicks], seconds: float, hz: float) -> Disturbance:
    """The :class:`Disturbance` of one phase from its workers' slices (``loaders``: the indexes of those whose
    running the phase assumes) and ``/proc/stat``'s steal around it (``seconds`` of wall time between the two
    reads, ``hz`` ticks a second)."""
    def steal(cpu: int) -> float:
        if cpu not in before or cpu not in after or seconds <= 0:
            return 0.0
        return (after[cpu].steal - before[cpu].steal) / (hz * seconds)

    lost = 1.0 - min((results[i].cpu_share for i in loaders), default=1.0)
    foreign = 1.0 - min((r.cpu_share for r in results), default=1.0)
    stolen = max((steal(r.cpu) for r in results), default=0.0)
    return Disturbance(max(0.0, lost), max(0.0, foreign), max(0.0, stolen))


@dataclass(frozen=True)
class Round:
    probe_alone_bytes_per_second: float
    hog_alone_bytes_per_second: float
    peak_bytes_per_second: float
    probe_beside_hog_bytes_per_second: float
    hog_beside_probe_bytes_per_second: float
    throttled_hog_alone_bytes_per_second: float  # the hog at the first throttle duty, alone
    probe_beside_throttled_hog_bytes_per_second: float
    throttled_hog_beside_probe_bytes_per_second: float
    first_hog_alone_bytes_per_second: float  # the peak phase's hog on the probe's CPU, alone
    second_throttled_hog_alone_bytes_per_second: float  # the hog at the second throttle duty, alone
    probe_beside_second_throttled_hog_bytes_per_second: float
    second_throttled_hog_beside_probe_bytes_per_second: float
    throttled_hog_stream_share: float  # the share of its CPU time the throttled hog streamed, alone
    second_throttled_hog_stream_share: float  # the same at the second duty
    disturbance: Disturbance = field(default_factory=Disturbance)  # the worst over the round's phases

    @property
    def slowdown(self) -> float:
        return self.probe_alone_bytes_per_second / self.probe_beside_hog_bytes_per_second - 1.0

    @property
    def throttled_slowdown(self) -> float:
        return self.probe_alone_bytes_per_second / self.probe_beside_throttled_hog_bytes_per_second - 1.0

    @property
    def second_throttled_slowdown(self) -> float:
        return self.probe_alone_bytes_per_second / self.probe_beside_second_throttled_hog_bytes_per_second - 1.0

    def peak_alone(self, workers: int, peak_first: str = "hog") -> list[float]:
        """What each of the peak phase's ``workers`` streams draws alone: the stream on the probe's CPU (the first
        hog, or the probe with ``peak_first="probe"``) and the hog on the hog's CPU as measured alone; any further
        one (more than two cores) as the hog alone."""
        first = self.probe_alone_bytes_per_second if peak_first == "probe" else self.first_hog_alone_bytes_per_second
        return [first] + [self.hog_alone_bytes_per_second] * (workers - 1)

    @property
    def clean(self) -> bool:
        return self.disturbance.share <= MAX_DISTURBANCE


# The three operating points: the attribute prefix of each one's hog in a Round.
FULL, THROTTLED, SECOND_THROTTLED = "", "throttled_", "second_throttled_"


@dataclass(frozen=True)
class Measured:
    """The probe beside the full hog (the point the capacity is fitted to): what was measured."""

    hog_alone_bytes_per_second: float
    probe_beside_bytes_per_second: float
    hog_beside_bytes_per_second: float
    measured_slowdown: float  # median over the clean rounds of the probe's slowdown within the round
    measured_slowdown_interval: tuple[float, float]  # its distribution-free 95 % interval
    measured_slowdown_trimmed_mean: float  # the 20 % trimmed mean of the same ratios


@dataclass(frozen=True)
class Validation:
    """A held-out operating point: the probe beside a throttled hog, measured against predicted."""

    hog_duty: float  # the share of its time the hog was told to stream
    hog_stream_share: float  # the share of its CPU time it streamed, alone (median over the clean rounds)
    hog_alone_bytes_per_second: float  # what the throttled hog draws alone (its mean offered load)
    probe_beside_bytes_per_second: float
    hog_beside_bytes_per_second: float
    measured_slowdown: float  # median over the clean rounds of the probe's slowdown within the round
    measured_slowdown_interval: tuple[float, float]  # its distribution-free 95 % interval
    measured_slowdown_trimmed_mean: float  # the 20 % trimmed mean of the same ratios
    predicted_slowdown: float  # the declared model (predict_bursts) at the fitted capacity
    predicted_slowdown_interval: tuple[float, float]  # 95 % interval of the rounds' own fits and predictions
    error: float  # predicted − measured (fractions of the probe's time alone)
    relative_error: float | None  # predicted / measured − 1
    within_tolerance: bool
    predicted_inside_measured_interval: bool  # the prediction lies in the measured slowdown's 95 % interval
    predicted_slowdown_mean_load: float  # the former reading: the hog as its mean load (hog_alone) at the capacity


@dataclass(frozen=True)
class PeakFit:
    """The former fit, reported beside the verdict: the capacity at which the curve makes the peak phase's
    streams, each at what it drew alone, lose together what they lost (``fit_capacity``), and the three points
    predicted with it."""

    first_hog_alone_bytes_per_second: float  # the peak phase's hog on the probe's CPU, alone
    peak_bytes_per_second: float  # the peak phase's total
    peak_lost_share: float  # median over the rounds of 1 − peak / Σ what its streams drew alone
    fitted_capacity_bytes_per_second: float | None  # None: the peak lost nothing measurable
    fitted_capacity_interval: tuple[float, float]  # 95 % interval of the rounds' own fits (inf: no loss)
    peak_utilisation: float | None  # peak / fitted capacity
    full_predicted_slowdown: float
    full_relative_error: float | None  # predicted / measured − 1
    throttled_predicted_slowdown: float
    throttled_relative_error: float | None
    second_throttled_predicted_slowdown: float
    second_throttled_relative_error: float | None


@dataclass(frozen=True)
class Calibration:
    cpus: tuple[int, int]  # probe, hog
    peak_cpus: list[int]
    array_mib: int
    hog: str  # the hog's kernel: "read" (the probe's) or "copy"
    throttle_duty: float  # the first throttled hog streams this share of its time
    second_throttle_duty: float  # and the second one this share
    peak_first: str  # what streams on the probe's CPU in the peak phase: "hog" (its own process) or "probe"
    rounds: list[Round]
    clean_rounds: list[int]  # indexes of the rounds everything below is computed from
    slice_seconds: float
    verdict: str  # "within ±25 %", "outside ±25 %", "no slowdown to fit ..." or "not enough clean rounds: ..."
    # CPU time others took from the calibration's workers (other processes and steal), over every round: the
    # median and the largest of the rounds' worst phase. A noisy run shows here.
    foreign_share: float | None
    foreign_share_max: float | None
    steal_share: float | None  # the median of the rounds' worst phase's /proc/stat steal: part of the above
    probe_alone_bytes_per_second: float | None  # medians over the clean rounds
    hog_alone_bytes_per_second: float | None
    # The fit: the capacity at which the curve predicts the probe's measured slowdown beside the full hog.
    fitted_capacity_bytes_per_second: float | None
    fitted_capacity_interval: tuple[float, float] | None  # 95 % interval of the rounds' own fits (inf: none)
    full: Measured | None  # the fitted point: the probe beside the hog streaming all the time
    throttled: Validation | None  # held out: beside the hog at throttle_duty
    second_throttled: Validation | None  # held out: beside the hog at second_throttle_duty
    within_tolerance: bool | None  # both held-out points within ±25 %
    peak_fit: PeakFit | None  # the capacity fitted to the peak phase instead, with its predictions (not the verdict)
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


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics ``x_(k)``, ``x_(n+1−k)`` with the
    largest ``k`` such that ``2 P(Binomial(n, ½) < k) ≤ 1 − confidence`` (the sign-test interval, e.g.
    Hollander & Wolfe, *Nonparametric Statistical Methods*, §3.6). With too few values for that
    confidence (n < 6 at 95 %) it is the whole range."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    k = max(sign_test_rank(n, confidence), 1)
    return xs[k - 1], xs[n - k]


def sign_test_rank(n: int, confidence: float = CONFIDENCE) -> int:
    """The 1-based rank ``k`` of the sign-test interval's lower end for ``n`` values (:func:`median_interval`):
    the largest with ``2 P(Binomial(n, ½) < k) ≤ 1 − confidence``; 0 when ``n`` is too small for ``confidence``.
    In integers (``2**n P(B ≤ k)`` against the exact value of ``1 − confidence``): ``2.0**n`` overflows a float
    beyond n = 1023, which a bench of 1,200 paired lifecycles reached."""
    alpha_scaled = Fraction(1.0 - confidence) * 2**n  # (1 − confidence) 2**n, exactly
    k, count, c = 0, 0, 1  # c = C(n, k); count = 2**n P(B ≤ k)
    while k < n // 2:
        count += c
        if 2 * count > alpha_scaled:
            break
        c = c * (n - k) // (k + 1)
        k += 1
    return k


def trimmed_mean(values: Sequence[float], trim: float = TRIM) -> float:
    xs = sorted(values)
    cut = int(len(xs) * trim)
    kept = xs[cut:len(xs) - cut] or xs
    return float(np.mean(kept))


def predict_bursts(probe: float, hog: float, share: float, capacity: float | None) -> float:
    """The declared model of a throttled hog: while it streams it interferes as the full hog drawing ``hog``
    alone does, and while it spins not at all, so the probe's slowdown is the time average over the hog's
    ``share`` of time streaming — the probe moves ``B_p (1 − share) + B_p share / (1 + s_full)`` in a unit of
    time, with ``s_full`` the curve's slowdown beside the full hog (:func:`predict`). ``share`` 1 is the full
    hog itself."""
    full = predict(probe, hog, capacity)
    return 1.0 / ((1.0 - share) + share / (1.0 + full)) - 1.0


def _relative(predicted: float, measured: float) -> float | None:
    return predicted / measured - 1.0 if measured else None


def _median(used: Sequence[Round], attr: str) -> float:
    return float(np.median([getattr(r, attr) for r in used]))


def _slowdowns(used: Sequence[Round], point: str) -> list[float]:
    return [getattr(r, f"{point}slowdown") for r in used]


def _measured(used: list[Round]) -> Measured:
    ratios = _slowdowns(used, FULL)
    return Measured(_median(used, "hog_alone_bytes_per_second"), _median(used, "probe_beside_hog_bytes_per_second"),
                    _median(used, "hog_beside_probe_bytes_per_second"), float(np.median(ratios)),
                    median_interval(ratios), trimmed_mean(ratios))


def _validation(used: list[Round], capacity: float | None, round_capacities: list[float | None], bp: float,
                bh: float, point: str, duty: float) -> Validation:
    """The check at one held-out point (``point``: :data:`THROTTLED` or :data:`SECOND_THROTTLED`)."""
    bt = _median(used, f"{point}hog_alone_bytes_per_second")
    beside = _median(used, f"probe_beside_{point}hog_bytes_per_second")
    if min(bt, beside) <= 0:
        raise CalibrationError("a phase moved no bytes")
    share = _median(used, f"{point}hog_stream_share")
    ratios = _slowdowns(used, point)
    measured = float(np.median(ratios))
    lo, hi = median_interval(ratios)
    predicted = predict_bursts(bp, bh, share, capacity)
    per_round = [predict_bursts(r.probe_alone_bytes_per_second, r.hog_alone_bytes_per_second,
                                getattr(r, f"{point}hog_stream_share"), c)
                 for r, c in zip(used, round_capacities, strict=True)]
    err = predicted - measured
    return Validation(
        hog_duty=duty, hog_stream_share=share, hog_alone_bytes_per_second=bt, probe_beside_bytes_per_second=beside,
        hog_beside_bytes_per_second=_median(used, f"{point}hog_beside_probe_bytes_per_second"),
        measured_slowdown=measured, measured_slowdown_interval=(lo, hi),
        measured_slowdown_trimmed_mean=trimmed_mean(ratios),
        predicted_slowdown=predicted, predicted_slowdown_interval=median_interval(per_round),
        error=err, relative_error=_relative(predicted, measured),
        within_tolerance=abs(err) <= TOLERANCE * abs(measured),
        predicted_inside_measured_interval=lo <= predicted <= hi,
        predicted_slowdown_mean_load=predict(bp, bt, capacity))


def _peak_fit(used: list[Round], n: int, peak_first: str, bp: float, bh: float, full: Measured,
              throttled: Validation, second: Validation) -> PeakFit:
    """The capacity fitted to the peak phase (the former fit) and the three points predicted with it."""
    peak = _median(used, "peak_bytes_per_second")
    first = bp if peak_first == "probe" else _median(used, "first_hog_alone_bytes_per_second")
    if min(peak, first) <= 0:
        raise CalibrationError("a phase moved no bytes")
    alone = [first] + [bh] * (n - 1)
    # The loss is taken within each round (its peak against its own alone phases), like the slowdowns: the
    # median of paired ratios, not a ratio of medians, which drifts of the machine between rounds would bias.
    lost = float(np.median([1.0 - r.peak_bytes_per_second / sum(r.peak_alone(n, peak_first)) for r in used]))
    cap = fit_capacity(alone, (1.0 - lost) * sum(alone))
    caps = [fit_capacity(r.peak_alone(n, peak_first), r.peak_bytes_per_second) for r in used]
    p1 = predict(bp, bh, cap)
    p2 = predict_bursts(bp, bh, throttled.hog_stream_share, cap)
    p3 = predict_bursts(bp, bh, second.hog_stream_share, cap)
    return PeakFit(first, peak, lost, cap, median_interval([math.inf if c is None else c for c in caps]),
                   peak / cap if cap else None,
                   p1, _relative(p1, full.measured_slowdown), p2, _relative(p2, throttled.measured_slowdown),
                   p3, _relative(p3, second.measured_slowdown))


def summarise(cpus: tuple[int, int], peak_cpus: list[int], mib: int, rounds: list[Round], slice_seconds: float,
              weight: float, hog: str = "read", min_clean: int = MIN_CLEAN_ROUNDS,
              duty: float = THROTTLE_DUTY, peak_first: str = "hog",
              second_duty: float = SECOND_THROTTLE_DUTY) -> Calibration:
    """The report from measured rounds: pure arithmetic (tested without running anything). The capacity is
    fitted to the probe's slowdown beside the full hog; each held-out prediction uses that capacity and the
    alone phases, never the beside phase it is checked against."""
    if not rounds:
        raise CalibrationError("no rounds measured")
    clean = [i for i, r in enumerate(rounds) if r.clean]
    used = [rounds[i] for i in clean]
    foreign = [r.disturbance.foreign_share for r in rounds]
    base: dict[str, Any] = dict(
        cpus=cpus, peak_cpus=peak_cpus, array_mib=mib, hog=hog, throttle_duty=duty, second_throttle_duty=second_duty,
        peak_first=peak_first, rounds=rounds, clean_rounds=clean, slice_seconds=slice_seconds,
        foreign_share=float(np.median(foreign)), foreign_share_max=max(foreign),
        steal_share=float(np.median([r.disturbance.steal_share for r in rounds])))
    if len(used) < min_clean:
        return Calibration(
            **base, verdict=f"not enough clean rounds: {len(used)} of {len(rounds)} (need {min_clean})",
            probe_alone_bytes_per_second=None, hog_alone_bytes_per_second=None,
            fitted_capacity_bytes_per_second=None, fitted_capacity_interval=None, full=None, throttled=None,
            second_throttled=None, within_tolerance=None, peak_fit=None, memory_bandwidth_cost_per_second=None)
    bp, bh = _median(used, "probe_alone_bytes_per_second"), _median(used, "hog_alone_bytes_per_second")
    full = _measured(used)
    if min(bp, bh, full.probe_beside_bytes_per_second) <= 0:
        raise CalibrationError("a phase moved no bytes")
    capacity = fit_capacity_to_slowdown(bp, bh, full.measured_slowdown)
    round_caps = [fit_capacity_to_slowdown(r.probe_alone_bytes_per_second, r.hog_alone_bytes_per_second, r.slowdown)
                  for r in used]
    throttled = _validation(used, capacity, round_caps, bp, bh, THROTTLED, duty)
    second = _validation(used, capacity, round_caps, bp, bh, SECOND_THROTTLED, second_duty)
    within = throttled.within_tolerance and second.within_tolerance
    verdict = f"{'within' if within else 'outside'} ±{TOLERANCE:.0%}"
    if capacity is None:
        verdict += f" (no slowdown to fit: the probe beside the full hog measured {full.measured_slowdown:.4f})"
    return Calibration(
        **base, verdict=verdict, probe_alone_bytes_per_second=bp, hog_alone_bytes_per_second=bh,
        fitted_capacity_bytes_per_second=capacity,
        fitted_capacity_interval=median_interval([math.inf if c is None else c for c in round_caps]),
        full=full, throttled=throttled, second_throttled=second, within_tolerance=within,
        peak_fit=_peak_fit(used, len(peak_cpus), peak_first, bp, bh, full, throttled, second),
        memory_bandwidth_cost_per_second=weight * float(QUEUEING((bp + bh) / capacity)) if capacity else 0.0,
    )


def rounds_from_report(report: dict[str, Any]) -> list[Round]:
    """The rounds of a printed report (its JSON), clean or not."""
    try:
        return [Round(**{k: float(v) for k, v in r.items() if k != "disturbance"},
                      disturbance=Disturbance(**r["disturbance"])) for r in report["rounds"]]
    except (KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f"not a calibration report: {e}") from e


POOLED_SETTINGS = ("cpus", "peak_cpus", "array_mib", "hog", "throttle_duty", "second_throttle_duty", "slice_seconds",
                   "peak_first")
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
                         peak_first=str(first.get("peak_first", "hog")),
                         second_duty=float(first["second_throttle_duty"]))
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
    """Runs one phase's slices on several workers at once, a spinner on every calibration CPU the phase streams
    nothing on, and says what else happened meanwhile."""

    def __init__(self, proc: Path, spinners: dict[int, _Proc], slice_seconds: float):
        self.stat = Path(proc) / "stat"
        self.spinners = spinners
        self.slice = slice_seconds
        self.hz = float(os.sysconf("SC_CLK_TCK"))

    def _ticks(self) -> dict[int, CpuTicks]:
        try:
            return parse_cpu_ticks(self.stat.read_text())
        except OSError:
            return {}  # no steal figure then; the workers' lost time still shows what others took

    def run(self, workers: list[tuple[_Proc, float, float, float]], loaders: Sequence[int] = ()) -> _Phase:
        """``workers``: (worker, start offset, end offset beyond the slice, duty); ``loaders``: the indexes of
        those whose running the phase assumes (:func:`disturbance`; the spinners are loaders too)."""
        active = {w.cpu for w, _, _, _ in workers}
        last = max(b for _, _, b, _ in workers)
        spin = [(s, 0.0, last, 0.0) for c, s in sorted(self.spinners.items()) if c not in active]
        everyone = workers + spin
        before, t0 = self._ticks(), time.perf_counter()
        t = time.time() + START_SECONDS
        for w, a, b, duty in everyone:
            w.send(t + a, t + self.slice + b, duty)
        results = [w.result() for w, _, _, _ in everyone]
        after, seconds = self._ticks(), time.perf_counter() - t0
        all_loaders = list(loaders) + list(range(len(workers), len(everyone)))
        return _Phase(results[:len(workers)],
                      disturbance(results, all_loaders, before, after, seconds, self.hz))


@dataclass(frozen=True)
class _Phase:
    results: list[SliceResult]
    disturbance: Disturbance


def calibrate(topo: Topology, phase_seconds: float = 12.0, mib: int = 256, weight: float = 4.0,
              cpus: tuple[int, int] | None = None, hog: str = "read", proc: Path = Path("/proc"),
              slice_seconds: float = SLICE_SECONDS, max_rounds_factor: int = MAX_ROUNDS_FACTOR,
              max_seconds: float = MAX_SECONDS, duty: float = THROTTLE_DUTY, peak_first: str = "hog",
              second_duty: float = SECOND_THROTTLE_DUTY) -> Calibration:
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
    rounds: list[Round] = []
    try:
        probe = _Proc("probe", a, mib, "read", timeout)
        procs.append(probe)
        hogs = []
        for c in peak:
            hogs.append(_Proc("hog", c, mib, hog, timeout))
            procs.append(hogs[-1])
        hog_b = hogs[1]  # the hog on CPU b
        # Each CPU's hog spins on it whenever the phase streams nothing there (hogs[0] on the probe's CPU).
        phases = _Phases(proc, {h.cpu: h for h in hogs}, sl)

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
            # The probe's four phases next to each other, alone in turn first and last; then the others.
            if len(rounds) % 2 == 0:
                pa, pb, pt, pt2 = probe_alone(), beside(), beside(duty), beside(second_duty)
                ha, ht, ht2 = hog_alone(), hog_alone(duty), hog_alone(second_duty)
                h0, pk = first_hog_alone(), peak_phase()
            else:
                pt2, pt, pb, pa = beside(second_duty), beside(duty), beside(), probe_alone()
                pk, h0 = peak_phase(), first_hog_alone()
                ht2, ht, ha = hog_alone(second_duty), hog_alone(duty), hog_alone()
            rounds.append(Round(
                probe_alone_bytes_per_second=pa.results[0].bytes_per_second,
                hog_alone_bytes_per_second=ha.results[0].bytes_per_second,
                peak_bytes_per_second=sum(r.bytes_per_second for r in pk.results),
                probe_beside_hog_bytes_per_second=pb.results[1].bytes_per_second,
                hog_beside_probe_bytes_per_second=pb.results[0].bytes_per_second,
                throttled_hog_alone_bytes_per_second=ht.results[0].bytes_per_second,
                probe_beside_throttled_hog_bytes_per_second=pt.results[1].bytes_per_second,
                throttled_hog_beside_probe_bytes_per_second=pt.results[0].bytes_per_second,
                first_hog_alone_bytes_per_second=h0.results[0].bytes_per_second,
                second_throttled_hog_alone_bytes_per_second=ht2.results[0].bytes_per_second,
                probe_beside_second_throttled_hog_bytes_per_second=pt2.results[1].bytes_per_second,
                second_throttled_hog_beside_probe_bytes_per_second=pt2.results[0].bytes_per_second,
                throttled_hog_stream_share=ht.results[0].stream_share,
                second_throttled_hog_stream_share=ht2.results[0].stream_share,
                disturbance=Disturbance.worst([p.disturbance for p in (pa, pb, pt, pt2, ha, ht, ht2, h0, pk)])))
    finally:
        for p in procs:
            p.close()
    return summarise((a, b), peak, mib, rounds, sl, weight, hog, duty=duty, peak_first=peak_first,
                     second_duty=second_duty)


def _main(argv: list[str]) -> int:
    if len(argv) not in (3, 4) or argv[0] not in ("probe", "hog"):
        print("usage: python -m cri_resmgr.rebalancer.calibrate probe|hog CPU MIB [read|copy]", file=sys.stderr)
        return 2
    serve(argv[0], int(argv[1]), int(argv[2]), argv[3] if len(argv) == 4 else "read")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
