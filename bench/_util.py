"""Shared helpers for the benchmarks."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

# Benchmarks run from a checkout without installing: make the package importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def median_time(fn, repeat: int = 7) -> float:
    """Median wall time of ``repeat`` calls, in seconds."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)
