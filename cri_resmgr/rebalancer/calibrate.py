"""``cri-resmgr rebalance --calibrate``: the memory-bandwidth term against a measurement on this machine.

The interference this machine can produce for real is memory-bandwidth contention: a *hog* streaming
arrays far larger than the caches on one core, beside a memory-bound *probe* (a streaming read of
another such array) on another core. Every worker is a separate process pinned to its CPU
(``sched_setaffinity``) that allocates its arrays once and then streams in time slices it is told to
run; each slice reports bytes over the worker's own CPU time (``CLOCK_THREAD_CPUTIME_ID``), so time
the scheduler gives to other processes on that CPU is not counted as a slowdown. Short slices of the
four phases alternate, round after round (the probe's two phases next to each other, in turn first
and second), so that drifts of the machine fall on all of them alike:

1. **probe alone** — its bandwidth ``B_p``;
2. **hog alone** — ``B_h``;
3. **peak** — a hog on one CPU of each core of the probe's NUMA node, at most :data:`PEAK_WORKERS`
   (the probe's and the hog's CPUs first): their total is the capacity ``C`` a saturating streaming
   workload reaches (what ``rebalancer.numa_bandwidth_bytes_per_second`` means);
4. **probe beside hog** — the hog's slice starts before and ends after the probe's; the probe's
   bandwidth ``B_p'``. A round's slowdown is ``B_p / B_p' − 1`` (the probe-alone slice next to it).

**Clean rounds.** A round counts only if nothing else took more than :data:`MAX_DISTURBANCE` of any of
its phases (:class:`Disturbance`): every *loader* — the hog beside the probe, each hog of the peak
phase — ran for the rest of its slice's wall time (a hog kept off its CPU did not load memory), the
calibration's CPUs that a phase leaves idle ran nothing else (``/proc/stat``: another process beside
an "alone" worker may be a hog nobody measured), and the hog's slice covered the probe's. A worker's
own lost time is no disturbance: its bandwidth is over its own CPU time, which also excludes the
hypervisor's steal. Everything is computed over the clean rounds only — the measurement *and* the
prediction's inputs, so both come from the same moments of the machine. With fewer than
:data:`MIN_CLEAN_ROUNDS` clean rounds there is no measured figure: the report says "not enough clean
rounds" (and the command exits 1) rather than print a number it cannot trust. Rounds go on until
``--seconds`` of each phase were measured in clean rounds (60 rounds of 0.2 s by default), or four
times as many rounds were run, or :data:`MAX_SECONDS` passed: the stopping rule looks at how many
rounds were clean and at the clock, never at the figures.

**Estimators.** The measured slowdown is the median of the clean rounds' paired ratios, with a
distribution-free 95 % interval (order statistics of the median, :func:`median_interval`); the 20 %
trimmed mean is given beside it. The prediction's inputs ``B_p``, ``B_h``, ``C`` are medians over the
same rounds; its interval is the same order-statistic interval over each clean round's own prediction.

What *predicts*: the bandwidth term's own curve (:mod:`.bandwidth_curve`, fixed by a published
loaded-latency measurement, not by anything here): memory-bound work in a domain at offered load
``x`` runs ``slowdown_factor(x)`` times slower than on an idle domain, so the probe goes from
``x_p = B_p / C`` alone to ``x = (B_p + B_h) / C`` beside the hog::

    predicted = slowdown_factor((B_p + B_h) / C) / slowdown_factor(B_p / C) − 1

Phase 4 (what is predicted) enters nothing the prediction uses. The report also gives the former
hinge's prediction ``max(0, (B_p + B_h) / C − 1)``, for comparison, and the curve's own reading of the
peak phase (``model_peak_utilisation``): the share of ``C`` that a domain of capacity ``C`` delivers,
on the curve, to the peak phase's offered load ``n × B_h / C``. By the definition of ``C`` it should be
near 1; well below 1 says ``C`` is not a saturation point of the curve's kind — what a few cores can
draw, not what the memory can deliver — and the prediction is then outside the curve's ground.

**The hog's kernel** (``hog="read"``, the default) is the probe's own: a streaming read, so ``B_p``,
``B_h`` and ``C`` are all bytes read from memory — the one unit the model's offered load adds up. A
``"copy"`` hog (numpy copy, counted as bytes read plus bytes written) also moves read-for-ownership
traffic that it does not count: glibc copies 4 MiB chunks with ordinary stores below
``glibc.cpu.x86_non_temporal_threshold`` (192 MiB here), so each written line is first read. Its
``B_h`` and ``C`` then undercount the traffic by up to a third, against the probe's exact count.

Sizes: 256 MiB per array by default — eight times this machine's 32 MiB L3, beyond any L3 this project
targets (the largest fixture has 105 MiB per socket) — so every pass goes to memory.
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
from .bandwidth_curve import QUEUEING, slowdown_factor

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

    def run(self, start: float, end: float) -> SliceResult:
        """Stream from wall-clock time ``start`` until ``end`` (``time.time()``)."""
        while time.time() < start:
            pass
        moved = 0
        w0, c0, t0 = time.time(), time.thread_time(), time.perf_counter()
        n, k = len(self.src), self.chunk
        while time.time() < end:
            o = self.offset
            if self.dst is not None:  # copy: read one array, write the other
                np.copyto(self.dst[o:o + k], self.src[o:o + k])
                moved += 2 * 8 * min(k, n - o)
            else:  # read only
                self.src[o:o + k].sum()
                moved += 8 * min(k, n - o)
            self.offset = o + k if o + k < n else 0
        c1, t1, w1 = time.thread_time(), time.perf_counter(), time.time()
        return SliceResult(self.role, self.cpu, moved, c1 - c0, t1 - t0, sorted(os.sched_getaffinity(0)), w0, w1)


def serve(role: str, cpu: int, mib: int, kind: str = "read", stdin=sys.stdin, stdout=sys.stdout) -> None:
    """Worker protocol: "ready" once allocated, then for each line "start end" one JSON slice result."""
    w = Worker(role, cpu, mib, kind)
    print("ready", file=stdout, flush=True)
    for line in stdin:
        start, end = (float(v) for v in line.split())
        print(json.dumps(asdict(w.run(start, end))), file=stdout, flush=True)


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
    disturbance: Disturbance = field(default_factory=Disturbance)  # the worst over the round's phases

    @property
    def slowdown(self) -> float:
        return self.probe_alone_bytes_per_second / self.probe_beside_hog_bytes_per_second - 1.0

    @property
    def predicted(self) -> float:
        """This round's own prediction (from its own alone and peak phases)."""
        return predict(self.probe_alone_bytes_per_second, self.hog_alone_bytes_per_second,
                       self.peak_bytes_per_second)

    @property
    def clean(self) -> bool:
        return self.disturbance.share <= MAX_DISTURBANCE


@dataclass(frozen=True)
class Calibration:
    cpus: tuple[int, int]  # probe, hog
    peak_cpus: list[int]
    array_mib: int
    hog: str  # the hog's kernel: "read" (the probe's) or "copy"
    rounds: list[Round]
    clean_rounds: list[int]  # indexes of the rounds everything below is computed from
    slice_seconds: float
    verdict: str  # "within ±25 %", "outside ±25 %", or "not enough clean rounds: ..."
    # Measured, and what the prediction uses (medians over the clean rounds):
    probe_alone_bytes_per_second: float | None
    hog_alone_bytes_per_second: float | None
    capacity_bytes_per_second: float | None  # the peak phase's total
    # Measured, and what is predicted (None without enough clean rounds):
    probe_beside_hog_bytes_per_second: float | None
    hog_beside_probe_bytes_per_second: float | None
    measured_slowdown: float | None  # median over the clean rounds of the probe's slowdown within the round
    measured_slowdown_interval: tuple[float, float] | None  # its distribution-free 95 % interval
    measured_slowdown_trimmed_mean: float | None  # the 20 % trimmed mean of the same ratios
    # The model:
    offered_load_alone: float | None  # B_p / C
    offered_load_beside: float | None  # (B_p + B_h) / C
    predicted_slowdown: float | None
    predicted_slowdown_interval: tuple[float, float] | None  # 95 % interval of the rounds' own predictions
    error: float | None  # predicted − measured (fractions of the probe's time alone)
    relative_error: float | None  # |predicted − measured| / measured
    within_tolerance: bool | None
    memory_bandwidth_cost_per_second: float | None  # the term's cost of probe + hog in one domain of capacity C
    hinge_predicted_slowdown: float | None  # the former term: max(0, (B_p + B_h) / C − 1)
    # The model's own reading of the peak phase: its hogs offered n × B_h (each as much as the hog alone) and
    # delivered C; the curve says a domain of capacity C offered that delivers this share of C. Near 1 when
    # the peak phase saturates the domain; well below 1 when C is only what the calibration's cores can draw.
    peak_offered_load: float | None  # n × B_h / C
    model_peak_utilisation: float | None  # ρ(n × B_h / C) on the term's curve

    @property
    def conclusive(self) -> bool:
        return self.measured_slowdown is not None

    def as_dict(self) -> dict:
        return asdict(self)


def predict(probe: float, hog: float, capacity: float) -> float:
    """The bandwidth term's predicted slowdown of the probe beside the hog (see the module docstring)."""
    alone = float(slowdown_factor(probe / capacity))
    beside = float(slowdown_factor((probe + hog) / capacity))
    return beside / alone - 1.0


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


def summarise(cpus: tuple[int, int], peak_cpus: list[int], mib: int, rounds: list[Round], slice_seconds: float,
              weight: float, hog: str = "read", min_clean: int = MIN_CLEAN_ROUNDS) -> Calibration:
    """The report from measured rounds: pure arithmetic (tested without running anything)."""
    if not rounds:
        raise CalibrationError("no rounds measured")
    clean = [i for i, r in enumerate(rounds) if r.clean]
    used = [rounds[i] for i in clean]
    base: dict[str, Any] = dict(cpus=cpus, peak_cpus=peak_cpus, array_mib=mib, hog=hog, rounds=rounds,
                                clean_rounds=clean, slice_seconds=slice_seconds)
    if len(used) < min_clean:
        return Calibration(
            **base, verdict=f"not enough clean rounds: {len(used)} of {len(rounds)} (need {min_clean})",
            probe_alone_bytes_per_second=None, hog_alone_bytes_per_second=None, capacity_bytes_per_second=None,
            probe_beside_hog_bytes_per_second=None, hog_beside_probe_bytes_per_second=None,
            measured_slowdown=None, measured_slowdown_interval=None, measured_slowdown_trimmed_mean=None,
            offered_load_alone=None, offered_load_beside=None, predicted_slowdown=None,
            predicted_slowdown_interval=None, error=None, relative_error=None, within_tolerance=None,
            memory_bandwidth_cost_per_second=None, hinge_predicted_slowdown=None, peak_offered_load=None,
            model_peak_utilisation=None)

    def med(attr: str) -> float:
        return float(np.median([getattr(r, attr) for r in used]))

    bp, bh, cap = med("probe_alone_bytes_per_second"), med("hog_alone_bytes_per_second"), med("peak_bytes_per_second")
    if min(bp, bh, cap, med("probe_beside_hog_bytes_per_second")) <= 0:
        raise CalibrationError("a phase moved no bytes")
    ratios = [r.slowdown for r in used]
    measured = float(np.median(ratios))
    predicted = predict(bp, bh, cap)
    err = predicted - measured
    within = abs(err) <= TOLERANCE * abs(measured)
    return Calibration(
        **base, verdict=f"{'within' if within else 'outside'} ±{TOLERANCE:.0%}",
        probe_alone_bytes_per_second=bp, hog_alone_bytes_per_second=bh, capacity_bytes_per_second=cap,
        probe_beside_hog_bytes_per_second=med("probe_beside_hog_bytes_per_second"),
        hog_beside_probe_bytes_per_second=med("hog_beside_probe_bytes_per_second"),
        measured_slowdown=measured, measured_slowdown_interval=median_interval(ratios),
        measured_slowdown_trimmed_mean=trimmed_mean(ratios),
        offered_load_alone=bp / cap, offered_load_beside=(bp + bh) / cap,
        predicted_slowdown=predicted, predicted_slowdown_interval=median_interval([r.predicted for r in used]),
        error=err, relative_error=abs(err) / abs(measured) if measured else None, within_tolerance=within,
        memory_bandwidth_cost_per_second=weight * float(QUEUEING((bp + bh) / cap)),
        hinge_predicted_slowdown=max(0.0, (bp + bh) / cap - 1.0),
        peak_offered_load=len(peak_cpus) * bh / cap,
        model_peak_utilisation=len(peak_cpus) * bh / cap - float(QUEUEING(len(peak_cpus) * bh / cap)),
    )


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

    def send(self, start: float, end: float) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(f"{start!r} {end!r}\n")
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

    def run(self, workers: list[tuple[_Proc, float, float]], loaders: Sequence[int] = ()) -> _Phase:
        """``workers``: (worker, start offset, end offset beyond the slice); ``loaders``: see :func:`disturbance`."""
        before, t0 = self._ticks(), time.perf_counter()
        t = time.time() + START_SECONDS
        for w, a, b in workers:
            w.send(t + a, t + self.slice + b)
        results = [w.result() for w, _, _ in workers]
        after, seconds = self._ticks(), time.perf_counter() - t0
        active = {w.cpu for w, _, _ in workers}
        return _Phase(results, disturbance(results, loaders, before, after, seconds, self.hz,
                                           [c for c in self.cpus if c not in active]))


@dataclass(frozen=True)
class _Phase:
    results: list[SliceResult]
    disturbance: Disturbance


def calibrate(topo: Topology, phase_seconds: float = 12.0, mib: int = 256, weight: float = 4.0,
              cpus: tuple[int, int] | None = None, hog: str = "read", proc: Path = Path("/proc"),
              slice_seconds: float = SLICE_SECONDS, max_rounds_factor: int = MAX_ROUNDS_FACTOR,
              max_seconds: float = MAX_SECONDS) -> Calibration:
    """Rounds until ``phase_seconds`` of each phase were measured in clean rounds (``phase_seconds /
    slice_seconds`` of them), or ``max_rounds_factor`` times as many rounds were run, or ``max_seconds``
    have passed. The stopping rule looks only at how many rounds were clean and at the clock, never at
    the rounds' figures."""
    if hog not in HOG_KINDS:
        raise ValueError(f"hog must be one of {', '.join(HOG_KINDS)}")
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
            return phases.run([(probe, 0.0, 0.0)])

        def hog_alone() -> _Phase:
            return phases.run([(hog_b, 0.0, 0.0)])

        def peak_phase() -> _Phase:
            return phases.run([(h, 0.0, 0.0) for h in hogs], loaders=range(len(hogs)))

        def beside() -> _Phase:
            ph = phases.run([(hog_b, 0.0, 2 * LEAD_SECONDS), (probe, LEAD_SECONDS, 0.0)], loaders=[0])
            hb, pb = ph.results
            d = ph.disturbance
            return _Phase(ph.results, Disturbance(d.loader_share_lost, d.foreign_share, d.steal_share,
                                                  hb.start <= pb.start and hb.end >= pb.end))

        deadline = time.monotonic() + max_seconds
        while (sum(r.clean for r in rounds) < wanted and len(rounds) < max_rounds_factor * wanted
               and time.monotonic() < deadline):
            # The probe's two phases next to each other, in turn first and second; then the others.
            if len(rounds) % 2 == 0:
                pa, pb = probe_alone(), beside()
                ha, pk = hog_alone(), peak_phase()
            else:
                pb, pa = beside(), probe_alone()
                pk, ha = peak_phase(), hog_alone()
            rounds.append(Round(pa.results[0].bytes_per_second, ha.results[0].bytes_per_second,
                                sum(r.bytes_per_second for r in pk.results), pb.results[1].bytes_per_second,
                                pb.results[0].bytes_per_second,
                                Disturbance.worst([pa.disturbance, pb.disturbance, ha.disturbance, pk.disturbance])))
    finally:
        for p in procs:
            p.close()
    return summarise((a, b), peak, mib, rounds, sl, weight, hog)


def _main(argv: list[str]) -> int:
    if len(argv) not in (3, 4) or argv[0] not in ("probe", "hog"):
        print("usage: python -m cri_resmgr.rebalancer.calibrate probe|hog CPU MIB [read|copy]", file=sys.stderr)
        return 2
    serve(argv[0], int(argv[1]), int(argv[2]), argv[3] if len(argv) == 4 else "read")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
