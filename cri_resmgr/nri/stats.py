"""The NRI plugin's own metrics: requests by event and result, answer latency, registration state.

Recording is a dict update and a bisect under a lock; the Prometheus text is built only when asked for (the
control socket's ``Metrics`` call, which the agent appends to its ``/metrics``), by the project's one text
writer (:mod:`cri_resmgr.export.exposition`).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from .. import metrics as M
from ..export.exposition import format_family, format_histogram

# 50 µs doubling to ~3.3 s: hooks take well under a millisecond; containerd gives up at 2 s.
BUCKETS = tuple(50e-6 * 2**i for i in range(17))
EVENTS = frozenset({"Configure", "Synchronize", "Shutdown", "CreateContainer", "UpdateContainer", "StopContainer",
                    "StateChange", "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "StartContainer",
                    "RemoveContainer", "PostCreateContainer", "PostStartContainer", "PostUpdateContainer"})
RESULTS = frozenset({"ok", "error", "timeout", "unimplemented"})


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    n: int = 0


class NriStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}
        self._hist: dict[str, _Histogram] = {}
        self.connected = False

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
        return (format_family(M.NRI_REQUESTS, [((("event", e), ("result", r)), float(v)) for (e, r), v in reqs])
                + format_histogram(M.NRI_REQUEST_DURATION, hists)
                + format_family(M.NRI_CONNECTED, [((), float(self.connected))]))
