"""Fast Prometheus text exposition (format 0.0.4) of the store's latest values.

prometheus-client's ``generate_latest`` formats every label set on every scrape (~20 µs per series
here); a node with 20 k series would spend half a second per scrape. This writer caches each series'
``name{labels}`` prefix, so a scrape only formats values. Its output is checked against
``generate_latest`` over the same store (:class:`~cri_resmgr.export.reference.StoreCollector`) in the tests
(parsed with prometheus-client's own parser), so the library stays the reference for the format.

Format: https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import metrics as M

if TYPE_CHECKING:  # the relay and the NRI plugin use the writers below without the store (numpy, ~100 ms)
    from ..store import Store


@dataclass(frozen=True)
class DirectSample:
    """A value that lives outside the store (agent self-metrics), exported next to the store's series."""

    spec: M.MetricSpec
    labels: dict[str, str]
    value: float


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


def format_family(spec: M.MetricSpec, samples: Iterable[tuple[Iterable[tuple[str, str]], float]]) -> str:
    """One metric family in text format 0.0.4: HELP and TYPE, then a line per (labels, value). For writers of
    values that live outside the store (the relay's own statistics), so every text writer escapes the same way."""
    return _family_head(spec) + "".join(_series_prefix(spec.name, labels) + format_value(v) + "\n"
                                        for labels, v in samples)


def format_histogram(spec: M.MetricSpec,
                     rows: Iterable[tuple[Iterable[tuple[str, str]], Sequence[float], Sequence[int], float]]) -> str:
    """A histogram family: per row (labels, upper bounds without +Inf, per-bucket counts with the +Inf bucket last
    (not cumulative), sum of the observations) the cumulative ``_bucket{le}`` series, ``_sum`` and ``_count``."""
    out = [_family_head(spec)]
    for labels, bounds, counts, total in rows:
        labels = list(labels)
        if len(counts) != len(bounds) + 1:
            raise ValueError(f"{spec.name}: {len(counts)} bucket counts for {len(bounds)} bounds (+Inf last)")
        acc = 0
        for le, c in zip((*bounds, math.inf), counts, strict=True):
            acc += c
            out.append(_series_prefix(f"{spec.name}_bucket", [*labels, ("le", format_value(float(le)))])
                       + f"{acc}\n")
        out.append(_series_prefix(f"{spec.name}_sum", labels) + format_value(total) + "\n")
        out.append(_series_prefix(f"{spec.name}_count", labels) + f"{acc}\n")
    return "".join(out)


def _family_head(spec: M.MetricSpec) -> str:
    return f"# HELP {spec.name} {_escape_help(spec.help)}\n# TYPE {spec.name} {spec.type}\n"


class Exposition:
    def __init__(self, store: Store, direct: Callable[[], Iterable[DirectSample]] = lambda: ()):
        self.store = store
        self.direct = direct
        self._prefix: dict[int, tuple] = {}
        self._header: dict[str, str] = {}

    def _head(self, spec: M.MetricSpec) -> str:
        h = self._header.get(spec.name)
        if h is None:
            h = self._header[spec.name] = _family_head(spec)
        return h

    def render(self) -> bytes:
        store = self.store
        # Python lists: indexing them and repr() of Python floats is several times faster than numpy scalars.
        vectors = {t: (live.tolist(), vals.tolist()) for t, (live, vals) in store.latest_vectors().items()}
        out: list[str] = []
        prefix = self._prefix
        index = store.series_by_metric()
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
                out.append(self._head(M.spec_of(metric)))
                out.append("\n".join(lines))
                out.append("\n")
        direct: dict[str, list[tuple[list[tuple[str, str]], float]]] = {}
        specs: dict[str, M.MetricSpec] = {}
        for d in self.direct():
            specs[d.spec.name] = d.spec
            direct.setdefault(d.spec.name, []).append((sorted(d.labels.items()), d.value))
        out += [format_family(specs[name], rows) for name, rows in direct.items()]
        return "".join(out).encode()
