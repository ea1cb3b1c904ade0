"""The NRI plugin's own metrics: requests by event and result, answer latency, registration state; where the
answer time went (:mod:`.trace`): its parts per event, slow requests by cause, the garbage collector's pauses.

Recording is a dict update and a bisect under a lock; the Prometheus text is built only when asked for (the
control socket's ``Metrics`` call, which the agent appends to its ``/metrics``), by the project's one text
writer (:mod:`cri_resmgr.export.exposition`).
"""

from __future__ import annotations

import bisect
import heapq
import logging
import threading
from dataclasses import dataclass, field

from .. import metrics as M
from ..export.exposition import format_family, format_histogram
from .trace import SLOW_SECONDS, GcPauses, HookTrace

log = logging.getLogger(__name__)

# 50 µs doubling to ~3.3 s: hooks take well under a millisecond; containerd gives up at 2 s.
BUCKETS = tuple(50e-6 * 2**i for i in range(17))
EVENTS = frozenset({"Configure", "Synchronize", "Shutdown", "CreateContainer", "UpdateContainer", "StopContainer",
                    "StateChange", "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "StartContainer",
                    "RemoveContainer", "PostCreateContainer", "PostStartContainer", "PostUpdateContainer"})
RESULTS = frozenset({"ok", "error", "timeout", "unimplemented"})
PARTS = ("cpu", "runqueue", "blocked", "steal")
SLOWEST_KEPT = 16


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    n: int = 0


class NriStats:
    def __init__(self, gc_pauses: GcPauses | None = None, slow_seconds: float = SLOW_SECONDS) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._hist: dict[str, _Histogram] = {}
        self._parts: dict[tuple[str, str], float] = {}
        self._slow: dict[tuple[str, str], int] = {}
        self._slowest: list[tuple[float, int, HookTrace]] = []  # a min-heap of the slowest answers
        self._seq = 0
        self.gc_pauses = gc_pauses
        self.slow_seconds = slow_seconds
        self.connected = False

    def record_trace(self, t: HookTrace) -> None:
        """Where one answer's time went; a slow one is logged with its breakdown (after the answer is sent)."""
        ev = t.event if t.event in EVENTS else "other"
        slow = t.wall_seconds > self.slow_seconds
        with self._lock:
            for part, v in zip(PARTS, (t.cpu_seconds, t.runqueue_seconds, t.blocked_seconds, t.steal_seconds),
                               strict=True):
                self._parts[(ev, part)] = self._parts.get((ev, part), 0.0) + v
            if slow:
                self._slow[(ev, t.cause)] = self._slow.get((ev, t.cause), 0) + 1
            self._seq += 1
            entry = (t.wall_seconds, self._seq, t)
            if len(self._slowest) < SLOWEST_KEPT:
                heapq.heappush(self._slowest, entry)
            elif entry > self._slowest[0]:
                heapq.heapreplace(self._slowest, entry)
        if slow:
            log.info("slow NRI answer: %s", t.describe())
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("NRI answer: %s", t.describe())

    def slowest(self) -> list[HookTrace]:
        """The slowest answers so far (up to SLOWEST_KEPT), slowest first."""
        with self._lock:
            return [t for _, _, t in sorted(self._slowest, reverse=True)]

    def slow_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._slow)

    def record(self, event: str, result: str, seconds: float) -> None:
        # Only NRI's own names become label values: a peer inventing method names must not grow the series set.
        ev = event if event in EVENTS else "other"
        res = result if result in RESULTS else "other"
        i = bisect.bisect_left(BUCKETS, seconds)
        with self._lock:
            self._requests[(ev, res)] = self._requests.get((ev, res), 0) + 1
            h = self._hist.get(ev)
            if h is None:
                h = self._hist[ev] = _Histogram()
            h.counts[i] += 1
            h.total += seconds
            h.n += 1

    def count(self, event: str, result: str) -> int:
        with self._lock:
            return self._requests.get((event, result), 0)

    def render(self) -> str:
        with self._lock:
            reqs = sorted(self._requests.items())
            hists = [((("event", e),), BUCKETS, list(h.counts), h.total) for e, h in sorted(self._hist.items())]
            parts = sorted(self._parts.items())
            slow = sorted(self._slow.items())
        text = (format_family(M.NRI_REQUESTS, [((("event", e), ("result", r)), float(v)) for (e, r), v in reqs])
                + format_histogram(M.NRI_REQUEST_DURATION, hists)
                + format_family(M.NRI_CONNECTED, [((), float(self.connected))]))
        if parts:
            text += format_family(M.NRI_REQUEST_TIME, [((("event", e), ("part", p)), v) for (e, p), v in parts])
            text += format_family(M.NRI_SLOW_REQUESTS,
                                  [((("event", e), ("cause", c)), float(v)) for (e, c), v in slow])
        if self.gc_pauses is not None:
            gen = [str(g) for g in range(3)]
            text += format_family(M.NRI_GC_PAUSES, [((("generation", g),), float(n))
                                                    for g, n in zip(gen, self.gc_pauses.count, strict=True)])
            text += format_family(M.NRI_GC_PAUSE_TIME, [((("generation", g),), s)
                                                        for g, s in zip(gen, self.gc_pauses.seconds, strict=True)])
        return text
