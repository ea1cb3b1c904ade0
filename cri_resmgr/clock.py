"""The agent's sample clock: wall-clock seconds that never step back.

The wall clock steps (NTP corrections, a VM restored from a snapshot, an operator's ``date -s``). Samples
must keep their spacing all the same: a counter's rate is its increase over the time between samples, and
a remote-write receiver drops a batch whose timestamps repeat. So time advances with the monotonic clock,
anchored to the wall clock at start; a forward step of the wall clock (a suspend, which CLOCK_MONOTONIC
does not count, or a correction) is followed, a backward step is not: the agent's time then runs ahead of
the wall clock by the step, which :attr:`SteadyClock.ahead_seconds` reports, until the agent restarts (and
the checkpoint's samples from that future are dropped at restore, see store/checkpoint.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class SteadyClock:
    """Callable returning Unix seconds that never decrease. ``wall`` and ``monotonic`` are injectable."""

    def __init__(self, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 tolerance_seconds: float = 1.0):
        self.wall = wall
        self.monotonic = monotonic
        self.tolerance_seconds = tolerance_seconds
        self._offset = wall() - monotonic()
        self._last = -float("inf")
        self._lock = threading.Lock()
        self.ahead_seconds = 0.0  # how far this clock runs ahead of the wall clock (after a backward step)
        self.backward_steps_total = 0
        self.forward_steps_total = 0

    def __call__(self) -> float:
        with self._lock:
            w, m = self.wall(), self.monotonic()
            t = m + self._offset
            drift = w - t
            if drift > self.tolerance_seconds:
                # The wall clock jumped ahead (or time passed in suspend): follow it, samples get a gap.
                self._offset += drift
                self.forward_steps_total += 1
                self.ahead_seconds = 0.0
                t = w
            elif drift < -self.tolerance_seconds:
                if self.ahead_seconds <= self.tolerance_seconds:
                    self.backward_steps_total += 1
                self.ahead_seconds = -drift
            else:
                self.ahead_seconds = max(0.0, -drift)
            t = max(t, self._last)
            self._last = t
            return t
