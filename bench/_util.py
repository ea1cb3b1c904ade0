"""Shared helpers for the benchmarks."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

# Benchmarks run from a checkout without installing: make the package importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cpu_seconds(pid: int) -> float:
    # proc(5): /proc/<pid>/stat fields 14 and 15 are utime and stime in clock ticks
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_time(fn, repeat: int = 7) -> float:
    """Median wall time of ``repeat`` calls, in seconds."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)
