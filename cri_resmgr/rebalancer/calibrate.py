"""``cri-resmgr rebalance --calibrate``: the memory-bandwidth term against a measurement on this machine.

The interference this machine can produce for real is memory-bandwidth contention: a *hog* streaming
through arrays far larger than the caches on one core, beside a memory-bound *probe* (a streaming read
of another such array) on another core. Four phases, each a few seconds, every worker a separate
process pinned to its CPU (``sched_setaffinity``):

1. the probe alone — its bandwidth ``B_p``;
2. the hog alone — ``B_h``;
3. two hogs at once, one per CPU — their total is the node's capacity ``C`` as this machine delivers it
   to two cores;
4. the probe beside the hog — the probe's bandwidth ``B_p'``; measured slowdown ``B_p / B_p' − 1``.

The model's :class:`~.terms.MemoryBandwidth` term says demand beyond a node's capacity stalls every
memory-bound container of the node: with demand ``D = B_p + B_h`` above ``C`` each gets its share
``C × B / D``, so the probe's predicted slowdown is ``max(0, D / C − 1)`` — and zero below capacity.
The report gives both slowdowns, the error, the term's cost for the pair and the capacity that would
make the prediction exact (a value for ``rebalancer.numa_bandwidth_bytes_per_second``).

Sizes: 256 MiB per array by default — beyond any L3 this project targets (the largest fixture has
105 MiB of L3 per socket) — so every pass goes to memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..topology import Topology

MIB = 2**20
TOLERANCE = 0.25  # the target: predicted within ±25 % of measured


@dataclass(frozen=True)
class WorkerResult:
    role: str
    cpu: int
    bytes_per_second: float
    passes: int
    seconds: float
    cpus_allowed: list[int]  # the worker's affinity while it ran: its CPU only


def run_worker(role: str, cpu: int, seconds: float, mib: int) -> WorkerResult:
    """The body of one worker process: pin, allocate, then stream until ``seconds`` have passed."""
    os.sched_setaffinity(0, {cpu})
    n = mib * MIB // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src) if role == "hog" else None
    src.sum()  # fault the pages in before timing
    if dst is not None:
        np.copyto(dst, src)
    passes, moved = 0, 0
    t0 = time.perf_counter()
    while True:
        if dst is not None:  # hog: read one array, write the other
            np.copyto(dst, src)
            moved += 2 * src.nbytes
        else:  # probe: read only
            src.sum()
            moved += src.nbytes
        passes += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return WorkerResult(role, cpu, moved / elapsed, passes, elapsed, sorted(os.sched_getaffinity(0)))


def _spawn(role: str, cpu: int, seconds: float, mib: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "cri_resmgr.rebalancer.calibrate", role, str(cpu), str(seconds), str(mib)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)  # no shell: argv only


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[WorkerResult]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise CalibrationError(f"worker exited with status {p.returncode}")
        out.append(WorkerResult(**json.loads(stdout)))
    return out


class CalibrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Calibration:
    cpus: tuple[int, int]
    array_mib: int
    phase_seconds: float
    probe_alone_bytes_per_second: float
    hog_alone_bytes_per_second: float
    capacity_bytes_per_second: float  # two hogs at once
    probe_beside_hog_bytes_per_second: float
    hog_beside_probe_bytes_per_second: float
    measured_slowdown: float
    predicted_slowdown: float
    error: float  # predicted − measured (fractions of the probe's time alone)
    relative_error: float  # |predicted − measured| / measured, NaN when nothing was measured
    within_tolerance: bool
    memory_bandwidth_cost_per_second: float  # the term's cost of the pair at the measured capacity
    fitted_capacity_bytes_per_second: float  # the capacity that would make the prediction exact

    def as_dict(self) -> dict:
        return asdict(self)


def pick_cpus(topo: Topology) -> tuple[int, int]:
    """Two online CPUs on different cores (the probe's and the hog's); ValueError when there are none."""
    by_core: dict[tuple[int, int], int] = {}
    for c in sorted(topo.cpus.values(), key=lambda c: c.id):
        by_core.setdefault((c.package, c.core), c.id)
    cpus = sorted(by_core.values())
    allowed = os.sched_getaffinity(0)
    cpus = [c for c in cpus if c in allowed]
    if len(cpus) < 2:
        raise ValueError("calibration needs two CPUs on different cores")
    return cpus[0], cpus[1]


def calibrate(topo: Topology, phase_seconds: float = 3.0, mib: int = 256, weight: float = 4.0,
              cpus: tuple[int, int] | None = None) -> Calibration:
    a, b = cpus or pick_cpus(topo)
    limit = 10 * phase_seconds + 60
    probe = _collect([_spawn("probe", a, phase_seconds, mib)], limit)[0]
    hog = _collect([_spawn("hog", b, phase_seconds, mib)], limit)[0]
    two = _collect([_spawn("hog", a, phase_seconds, mib), _spawn("hog", b, phase_seconds, mib)], limit)
    both = _collect([_spawn("probe", a, phase_seconds, mib), _spawn("hog", b, phase_seconds, mib)], limit)
    capacity = sum(w.bytes_per_second for w in two)
    measured = probe.bytes_per_second / both[0].bytes_per_second - 1.0
    demand = probe.bytes_per_second + hog.bytes_per_second
    predicted = max(0.0, demand / capacity - 1.0)
    rel = abs(predicted - measured) / abs(measured) if abs(measured) > 1e-9 else float("nan")
    within = abs(predicted - measured) <= TOLERANCE * max(abs(measured), 1e-9)
    # The capacity at which D / C − 1 equals the measured slowdown (none below zero slowdown).
    fitted = demand / (1.0 + measured) if measured > 0 else float("inf")
    return Calibration(
        cpus=(a, b), array_mib=mib, phase_seconds=phase_seconds,
        probe_alone_bytes_per_second=probe.bytes_per_second, hog_alone_bytes_per_second=hog.bytes_per_second,
        capacity_bytes_per_second=capacity, probe_beside_hog_bytes_per_second=both[0].bytes_per_second,
        hog_beside_probe_bytes_per_second=both[1].bytes_per_second, measured_slowdown=measured,
        predicted_slowdown=predicted, error=predicted - measured, relative_error=rel, within_tolerance=within,
        memory_bandwidth_cost_per_second=weight * max(0.0, demand - capacity) / capacity,
        fitted_capacity_bytes_per_second=fitted,
    )


def _main(argv: list[str]) -> int:
    role, cpu, seconds, mib = argv[0], int(argv[1]), float(argv[2]), int(argv[3])
    if role not in ("probe", "hog"):
        print(f"unknown role {role!r}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(run_worker(role, cpu, seconds, mib))))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
