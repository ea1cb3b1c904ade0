"""Fast Prometheus text exposition (format 0.0.4) of the store's latest values.

prometheus-client's ``generate_latest`` formats every label set on every scrape (~20 µs per series
here); a node with 20 k series would spend half a second per scrape. This writer caches each series'
``name{labels}`` prefix, so a scrape only formats values. Its output is checked against
``generate_latest`` over the same :class:`~cri_resmgr.export.prometheus.StoreCollector` in the tests
(parsed with prometheus-client's own parser), so the library stays the reference for the format.

Format: https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from .. import metrics as M
from ..store import Store
from .prometheus import DirectSample


def _escape_label(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_help(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n")


def format_value(v: float) -> str:
    # Same spelling as prometheus_client.utils.floatToGoString for the values we emit.
    if v != v:
        return "NaN"
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    return repr(float(v))


def _series_prefix(name: str, labels: Iterable[tuple[str, str]]) -> str:
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
    return f"{name}{{{inner}}} " if inner else f"{name} "


def _spec_for(metric: str) -> M.MetricSpec:
    spec = M.lookup(metric)
    if spec is None:
        spec = M.MetricSpec(metric, "counter" if metric.endswith("_total") else "gauge", f"{metric} (no metadata)")
    return spec


class Exposition:
    def __init__(self, store: Store, direct: Callable[[], Iterable[DirectSample]] = lambda: ()):
        self.store = store
        self.direct = direct
        self._prefix: dict[int, tuple] = {}
        self._header: dict[str, str] = {}

    def _head(self, spec: M.MetricSpec) -> str:
        h = self._header.get(spec.name)
        if h is None:
            h = self._header[spec.name] = f"# HELP {spec.name} {_escape_help(spec.help)}\n# TYPE {spec.name} {spec.type}\n"
        return h

    def render(self) -> bytes:
        store = self.store
        # Python lists: indexing them and repr() of Python floats is several times faster than numpy scalars.
        vectors = {t: (live.tolist(), vals.tolist()) for t, (live, vals) in store.latest_vectors().items()}
        out: list[str] = []
        prefix = self._prefix
        with store.lock:
            index = {m: list(series.values()) for m, series in store.index.items()}
        if len(prefix) > 4 * max(1024, store.series_count):
            prefix.clear()  # series churn: keep the cache bounded
        for metric, refs in index.items():
            lines = []
            table = None
            live = vals = ()
            for ref in refs:
                if ref.table != table:
                    table = ref.table
                    live, vals = vectors.get(table, ((), ()))
                col = ref.col
                if col >= len(live) or not live[col]:
                    continue
                # Keyed by id(): hashing the nested label tuples on every scrape is the main cost otherwise;
                # the identity check guards against a recycled id.
                entry = prefix.get(id(ref))
                if entry is None or entry[0] is not ref:
                    entry = prefix[id(ref)] = (ref, _series_prefix(metric, ref.labels))
                v = vals[col]
                lines.append(entry[1] + (repr(v) if v == v and v not in (math.inf, -math.inf) else format_value(v)))
            if lines:
                out.append(self._head(_spec_for(metric)))
                out.append("\n".join(lines))
                out.append("\n")
        direct: dict[str, list[str]] = {}
        specs: dict[str, M.MetricSpec] = {}
        for d in self.direct():
            specs[d.spec.name] = d.spec
            direct.setdefault(d.spec.name, []).append(
                _series_prefix(d.spec.name, sorted(d.labels.items())) + format_value(d.value))
        for name, lines in direct.items():
            out.append(self._head(specs[name]))
            out.append("\n".join(lines))
            out.append("\n")
        return "".join(out).encode()
