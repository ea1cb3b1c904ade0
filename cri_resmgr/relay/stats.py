"""Request counters and latency histograms of the relay, kept cheap enough for the forwarding path.

Recording is a dict update and a bisect under a lock (~1 µs); the Prometheus text is built only when
someone asks (the control socket's ``Metrics`` call, or ``relay.metrics_listen``), following the text
exposition format (prometheus/docs content/docs/instrumenting/exposition_formats.md: a histogram is
cumulative ``_bucket{le=...}`` series ending in ``+Inf``, plus ``_sum`` and ``_count``).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from .. import metrics as M

# 50 µs doubling to ~13 s: forwarded calls take 0.1-1 ms, container creation 0.1-1 s.
BUCKETS = tuple(50e-6 * 2**i for i in range(19))


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0
    n: int = 0


def _fmt(v: float) -> str:
    return repr(float(v)) if v != float("inf") else "+Inf"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class RelayStats:
    def __init__(self, known_methods: frozenset[str] = frozenset()):
        self.known = known_methods
        self.requests: dict[tuple[str, str], int] = {}
        self.hist: dict[str, _Histogram] = {}
        self.lock = threading.Lock()
        self.gauges: dict[str, float] = {}

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

    def count(self, method: str, code: str) -> int:
        with self.lock:
            return self.requests.get((method, code), 0)

    def render(self) -> str:
        with self.lock:
            reqs = sorted(self.requests.items())
            hists = {m: (_Histogram(list(h.counts), h.total, h.n)) for m, h in sorted(self.hist.items())}
            gauges = dict(self.gauges)
        out = []
        spec = M.RELAY_REQUESTS
        out.append(f"# HELP {spec.name} {spec.help}\n# TYPE {spec.name} counter\n")
        for (m, code), v in reqs:
            out.append(f'{spec.name}{{method="{_escape(m)}",code="{_escape(code)}"}} {v}\n')
        spec = M.RELAY_REQUEST_DURATION
        out.append(f"# HELP {spec.name} {spec.help}\n# TYPE {spec.name} histogram\n")
        for m, h in hists.items():
            acc = 0
            lab = f'method="{_escape(m)}"'
            for le, c in zip((*BUCKETS, float("inf")), h.counts):
                acc += c
                out.append(f'{spec.name}_bucket{{{lab},le="{_fmt(le)}"}} {acc}\n')
            out.append(f"{spec.name}_sum{{{lab}}} {_fmt(h.total)}\n{spec.name}_count{{{lab}}} {h.n}\n")
        for name, v in sorted(gauges.items()):
            s = M.lookup(name)
            if s is not None:
                out.append(f"# HELP {s.name} {s.help}\n# TYPE {s.name} {s.type}\n{s.name} {_fmt(v)}\n")
        return "".join(out)
