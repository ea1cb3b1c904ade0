"""Request counters and latency histograms of the relay, kept cheap enough for the forwarding path.

Recording is a dict update and a bisect under a lock (~1 µs); the Prometheus text is built only when
someone asks (the control socket's ``Metrics`` call, or ``relay.metrics_listen``), by the project's one text
writer (:mod:`cri_resmgr.export.exposition`: escaping and value spelling as prometheus_client).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections import deque
from dataclasses import dataclass, field

from .. import metrics as M
from ..export.exposition import format_family, format_histogram
from .h2proxy import RewriteTiming

# 50 µs doubling to ~13 s: forwarded calls take 0.1-1 ms, container creation 0.1-1 s.
BUCKETS = tuple(50e-6 * 2**i for i in range(19))
REWRITE_SAMPLES = 1000


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    n: int = 0


class RelayStats:
    def __init__(self, known_methods: frozenset[str] = frozenset()):
        self.known = known_methods
        self.requests: dict[tuple[str, str], int] = {}
        self.hist: dict[str, _Histogram] = {}
        self.lock = threading.Lock()
        self.gauges: dict[str, float] = {}
        self.resets: dict[str, int] = {}  # reason -> streams/connections the proxy ended itself
        # method -> the last REWRITE_SAMPLES held or observed requests' timings (control socket: Timings)
        self.rewrites: dict[str, deque[RewriteTiming]] = {}

    def reset(self, reason: str) -> None:
        with self.lock:
            self.resets[reason] = self.resets.get(reason, 0) + 1

    def method_label(self, path: str) -> str:
        # Only CRI methods get their own label: a client inventing paths must not grow the series set.
        name = path.rsplit("/", 1)[-1]
        return name if not self.known or path in self.known else "other"

    def record(self, path: str, code: str, seconds: float) -> None:
        m = self.method_label(path)
        i = bisect.bisect_left(BUCKETS, seconds)
        with self.lock:
            key = (m, code)
            self.requests[key] = self.requests.get(key, 0) + 1
            h = self.hist.get(m)
            if h is None:
                h = self.hist[m] = _Histogram()
            h.counts[i] += 1
            h.total += seconds
            h.n += 1

    def record_rewrite(self, path: str, timing: RewriteTiming) -> None:
        """A held or observed request's call ended: where its time in the relay went (kept as it is, read on demand)."""
        m = self.method_label(path)
        with self.lock:
            d = self.rewrites.get(m)
            if d is None:
                d = self.rewrites[m] = deque(maxlen=REWRITE_SAMPLES)
            d.append(timing)

    def rewrite_samples(self) -> dict[str, list[dict[str, float]]]:
        """method -> the last held or observed requests' :class:`RewriteTiming` fields, oldest first."""
        with self.lock:
            kept = {m: list(d) for m, d in self.rewrites.items()}
        return {m: [dataclasses.asdict(t) for t in ts] for m, ts in kept.items()}

    def count(self, method: str, code: str) -> int:
        with self.lock:
            return self.requests.get((method, code), 0)

    def render(self) -> str:
        with self.lock:
            reqs = sorted(self.requests.items())
            hists = {m: (_Histogram(list(h.counts), h.total, h.n)) for m, h in sorted(self.hist.items())}
            gauges = dict(self.gauges)
            resets = sorted(self.resets.items())
        out = [format_family(M.RELAY_REQUESTS, [([("method", m), ("code", code)], float(n)) for (m, code), n in reqs]),
               format_histogram(M.RELAY_REQUEST_DURATION,
                                [([("method", m)], BUCKETS, h.counts, h.total) for m, h in hists.items()]),
               format_family(M.RELAY_STREAMS_RESET, [([("reason", r)], float(n)) for r, n in resets])]
        for name, v in sorted(gauges.items()):
            spec = M.lookup(name)
            if spec is not None:
                out.append(format_family(spec, [((), v)]))
        return "".join(out)
