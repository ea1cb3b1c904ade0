"""``cri-resmgr rebalance --calibrate``: the memory-bandwidth term against a measurement on this machine.

The interference this machine can produce for real is memory-bandwidth contention: a *hog* copying
arrays far larger than the caches on one core, beside a memory-bound *probe* (a streaming read of
another such array) on another core. Every worker is a separate process pinned to its CPU
(``sched_setaffinity``) that allocates its arrays once and then streams in time slices it is told to
run; each slice reports bytes over the worker's own CPU time (``CLOCK_THREAD_CPUTIME_ID``), so time
the scheduler gives to other processes on that CPU is not counted as a slowdown. Slices of the four
phases alternate, round after round, so that drifts of the machine fall on all of them alike:

1. **probe alone** — its bandwidth ``B_p``;
2. **hog alone** — ``B_h``;
3. **peak** — a hog on one CPU of each core of the probe's NUMA node, at most :data:`PEAK_WORKERS`
   (the probe's and the hog's CPUs first): their total is the capacity ``C`` a saturating streaming
   workload reaches (what ``rebalancer.numa_bandwidth_bytes_per_second`` means);
4. **probe beside hog** — the hog's slice starts before and ends after the probe's; the probe's
   bandwidth ``B_p'``. The measured slowdown is the median over rounds of ``B_p / B_p' − 1`` within
   a round (the probe-alone slice next to it).

Rounds in which a worker got less than :data:`MIN_CPU_SHARE` of its slice's wall time (other processes
ran on its CPU: a hog that was off its CPU did not load memory) are left out of every median; the
report says how many were used.

What is *measured* for the model: ``B_p``, ``B_h`` and ``C``. What is *predicted*: the probe's slowdown
beside the hog, by the bandwidth term's own curve (:mod:`.bandwidth_curve`, fixed by a published
loaded-latency measurement, not by anything here): memory-bound work in a domain at offered load
``x`` runs ``slowdown_factor(x)`` times slower than on an idle domain, so the probe goes from
``x_p = B_p / C`` alone to ``x = (B_p + B_h) / C`` beside the hog::

    predicted = slowdown_factor((B_p + B_h) / C) / slowdown_factor(B_p / C) − 1

Phase 4 (what is predicted) enters nothing the prediction uses. The report also gives the former
hinge's prediction ``max(0, (B_p + B_h) / C − 1)`` and its fitted capacity, for comparison.

Sizes: 256 MiB per array by default — beyond any L3 this project targets (the largest fixture has
105 MiB of L3 per socket) — so every pass goes to memory.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..topology import Topology
from .bandwidth_curve import QUEUEING, slowdown_factor

MIB = 2**20
TOLERANCE = 0.25  # the target: predicted within ±25 % of measured
CHUNK_BYTES = 4 * MIB  # a worker checks the clock after each chunk: slices end within ~1 ms
SLICE_SECONDS = 0.5  # longest slice; a phase of --seconds is split into rounds of this at most
MIN_ROUNDS = 3
PEAK_WORKERS = 8  # at most this many hogs in the peak phase (memory: two arrays each)
LEAD_SECONDS = 0.03  # the hog starts this much before the probe's slice and ends as much after it
# A round counts only if every worker of it ran for at least this share of its slice: a hog that other
# processes kept off its CPU did not load memory for the whole slice (nor did the peak phase's hogs).
MIN_CPU_SHARE = 0.9


@dataclass(frozen=True)
class SliceResult:
    role: str
    cpu: int
    bytes: int
    cpu_seconds: float
    wall_seconds: float
    cpus_allowed: list[int]  # the worker's affinity while it ran: its CPU only

    @property
    def bytes_per_second(self) -> float:
        """Bytes over the worker's own CPU time."""
        return self.bytes / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    @property
    def cpu_share(self) -> float:
        return self.cpu_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


class Worker:
    """The body of one worker process: pin, allocate, then stream for each slice it is sent."""

    def __init__(self, role: str, cpu: int, mib: int):
        if role not in ("probe", "hog"):
            raise ValueError(f"unknown role {role!r}")
        os.sched_setaffinity(0, {cpu})
        self.role, self.cpu = role, cpu
        n = mib * MIB // 8
        self.src = np.ones(n, dtype=np.float64)
        self.dst = np.empty_like(self.src) if role == "hog" else None
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
        c0, t0 = time.thread_time(), time.perf_counter()
        n, k = len(self.src), self.chunk
        while time.time() < end:
            o = self.offset
            if self.dst is not None:  # hog: read one array, write the other
                np.copyto(self.dst[o:o + k], self.src[o:o + k])
                moved += 2 * 8 * min(k, n - o)
            else:  # probe: read only
                self.src[o:o + k].sum()
                moved += 8 * min(k, n - o)
            self.offset = o + k if o + k < n else 0
        return SliceResult(self.role, self.cpu, moved, time.thread_time() - c0, time.perf_counter() - t0,
                           sorted(os.sched_getaffinity(0)))


def serve(role: str, cpu: int, mib: int, stdin=sys.stdin, stdout=sys.stdout) -> None:
    """Worker protocol: "ready" once allocated, then for each line "start end" one JSON slice result."""
    w = Worker(role, cpu, mib)
    print("ready", file=stdout, flush=True)
    for line in stdin:
        start, end = (float(v) for v in line.split())
        print(json.dumps(asdict(w.run(start, end))), file=stdout, flush=True)


class CalibrationError(RuntimeError):
    pass


class _Proc:
    def __init__(self, role: str, cpu: int, mib: int, timeout: float):
        args = [sys.executable, "-m", "cri_resmgr.rebalancer.calibrate", role, str(cpu), str(mib)]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # argv only
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


def _phase(workers: list[tuple[_Proc, float, float]], slice_seconds: float) -> list[SliceResult]:
    """Run one slice on several workers at once: (worker, start offset, end offset beyond the slice)."""
    t = time.time() + 0.02
    for w, a, b in workers:
        w.send(t + a, t + slice_seconds + b)
    return [w.result() for w, _, _ in workers]


@dataclass(frozen=True)
class Round:
    probe_alone_bytes_per_second: float
    hog_alone_bytes_per_second: float
    peak_bytes_per_second: float
    probe_beside_hog_bytes_per_second: float
    hog_beside_probe_bytes_per_second: float
    min_cpu_share: float = 1.0  # the least CPU time over wall time of any worker's slice in the round

    @property
    def slowdown(self) -> float:
        return self.probe_alone_bytes_per_second / self.probe_beside_hog_bytes_per_second - 1.0


@dataclass(frozen=True)
class Calibration:
    cpus: tuple[int, int]  # probe, hog
    peak_cpus: list[int]
    array_mib: int
    rounds: list[Round]
    rounds_used: int  # rounds whose workers all ran ≥ MIN_CPU_SHARE of their slices (all, when none did)
    slice_seconds: float
    # Measured, and what the prediction uses (medians over rounds):
    probe_alone_bytes_per_second: float
    hog_alone_bytes_per_second: float
    capacity_bytes_per_second: float  # the peak phase's total
    # Measured, and what is predicted:
    probe_beside_hog_bytes_per_second: float
    hog_beside_probe_bytes_per_second: float
    measured_slowdown: float  # median over rounds of the probe's slowdown within the round
    # The model:
    offered_load_alone: float  # B_p / C
    offered_load_beside: float  # (B_p + B_h) / C
    predicted_slowdown: float
    error: float  # predicted − measured (fractions of the probe's time alone)
    relative_error: float  # |predicted − measured| / measured, NaN when nothing was measured
    within_tolerance: bool
    memory_bandwidth_cost_per_second: float  # the term's cost of probe + hog in one domain of capacity C
    hinge_predicted_slowdown: float  # the former term: max(0, (B_p + B_h) / C − 1)

    def as_dict(self) -> dict:
        return asdict(self)


def predict(probe: float, hog: float, capacity: float) -> float:
    """The bandwidth term's predicted slowdown of the probe beside the hog (see the module docstring)."""
    alone = float(slowdown_factor(probe / capacity))
    beside = float(slowdown_factor((probe + hog) / capacity))
    return beside / alone - 1.0


def summarise(cpus: tuple[int, int], peak_cpus: list[int], mib: int, rounds: list[Round], slice_seconds: float,
              weight: float) -> Calibration:
    """The report from measured rounds: pure arithmetic (tested without running anything)."""
    if not rounds:
        raise CalibrationError("no rounds measured")
    used = [r for r in rounds if r.min_cpu_share >= MIN_CPU_SHARE] or rounds

    def med(attr: str) -> float:
        return float(np.median([getattr(r, attr) for r in used]))

    bp, bh, cap = med("probe_alone_bytes_per_second"), med("hog_alone_bytes_per_second"), med("peak_bytes_per_second")
    if min(bp, bh, cap) <= 0:
        raise CalibrationError("a phase moved no bytes")
    measured = float(np.median([r.slowdown for r in used]))
    predicted = predict(bp, bh, cap)
    err = predicted - measured
    rel = abs(err) / abs(measured) if abs(measured) > 1e-9 else math.nan
    return Calibration(
        cpus=cpus, peak_cpus=peak_cpus, array_mib=mib, rounds=rounds, rounds_used=len(used),
        slice_seconds=slice_seconds,
        probe_alone_bytes_per_second=bp, hog_alone_bytes_per_second=bh, capacity_bytes_per_second=cap,
        probe_beside_hog_bytes_per_second=med("probe_beside_hog_bytes_per_second"),
        hog_beside_probe_bytes_per_second=med("hog_beside_probe_bytes_per_second"),
        measured_slowdown=measured, offered_load_alone=bp / cap, offered_load_beside=(bp + bh) / cap,
        predicted_slowdown=predicted, error=err, relative_error=rel,
        within_tolerance=abs(err) <= TOLERANCE * max(abs(measured), 1e-9),
        memory_bandwidth_cost_per_second=weight * float(QUEUEING((bp + bh) / cap)),
        hinge_predicted_slowdown=max(0.0, (bp + bh) / cap - 1.0),
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


def calibrate(topo: Topology, phase_seconds: float = 3.0, mib: int = 256, weight: float = 4.0,
              cpus: tuple[int, int] | None = None) -> Calibration:
    (a, b), peak = pick_cpus(topo)
    if cpus is not None:
        a, b = cpus
        peak = [a, b] + [c for c in peak if c not in (a, b)]
    n_rounds = max(MIN_ROUNDS, math.ceil(phase_seconds / SLICE_SECONDS))
    sl = phase_seconds / n_rounds
    timeout = 60.0 + 10 * sl
    procs: list[_Proc] = []
    try:
        probe = _Proc("probe", a, mib, timeout)
        procs.append(probe)
        hogs = []
        for c in peak:
            hogs.append(_Proc("hog", c, mib, timeout))
            procs.append(hogs[-1])
        hog = hogs[1]  # the hog on CPU b
        rounds = []
        for _ in range(n_rounds):
            pa = _phase([(probe, 0.0, 0.0)], sl)[0]
            ha = _phase([(hog, 0.0, 0.0)], sl)[0]
            pk = _phase([(h, 0.0, 0.0) for h in hogs], sl)
            hb, pb = _phase([(hog, 0.0, 2 * LEAD_SECONDS), (probe, LEAD_SECONDS, 0.0)], sl)
            share = min(r.cpu_share for r in [pa, ha, *pk, hb, pb])
            rounds.append(Round(pa.bytes_per_second, ha.bytes_per_second, sum(r.bytes_per_second for r in pk),
                                pb.bytes_per_second, hb.bytes_per_second, share))
    finally:
        for p in procs:
            p.close()
    return summarise((a, b), peak, mib, rounds, sl, weight)


def _main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("probe", "hog"):
        print("usage: python -m cri_resmgr.rebalancer.calibrate probe|hog CPU MIB", file=sys.stderr)
        return 2
    serve(argv[0], int(argv[1]), int(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
