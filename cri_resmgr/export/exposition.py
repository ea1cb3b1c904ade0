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
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import metrics as M

if TYPE_CHECKING:  # the relay and the NRI plugin use the writers below without the store (numpy, ~100 ms)
    import numpy as np

    from ..store import Store
    from ..store.tsdb import SeriesRef


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


@dataclass
class _Run:
    """Consecutive series of one metric that live in one table: their refs and columns, and their lines as last
    rendered from the values ``shown`` (a line is formatted again only when its value changed). A line is its
    ``name{labels} `` prefix (``plen[i]`` characters) and its value; the prefix is not kept apart, so the label text
    is held once (at 20 k series, prefixes and lines held apart took ~12 MB, the lines alone ~6 MB). Before the first
    scrape a line is its prefix alone."""

    table: str
    refs: list[SeriesRef]
    cols: np.ndarray
    plen: list[int]
    lines: list[str]
    shown: np.ndarray | None = None  # uint64 bit patterns of the values the lines hold; None: not rendered yet


class Exposition:
    """Renders the store's live series and the direct samples. What each series' line starts with is worked out
    once per change of the store's index (:attr:`Store.index_version`), and a line is formatted again only when
    its value changed since the last scrape: a scrape costs vector operations plus the series that changed."""

    def __init__(self, store: Store, direct: Callable[[], Iterable[DirectSample]] = lambda: ()):
        self.store = store
        self.direct = direct
        self._header: dict[str, str] = {}
        self._plan: tuple[int, list[tuple[str, list[_Run]]]] | None = None
        self._lock = threading.Lock()  # concurrent scrapes: one at a time updates the remembered lines

    def _head(self, spec: M.MetricSpec) -> str:
        h = self._header.get(spec.name)
        if h is None:
            h = self._header[spec.name] = _family_head(spec)
        return h

    def _families(self) -> list[tuple[str, list[_Run]]]:
        import numpy as np

        store = self.store
        if self._plan is not None and self._plan[0] == store.index_version:
            return self._plan[1]
        version, index = store.versioned_series()
        old_runs = [] if self._plan is None else [r for _, runs in self._plan[1] for r in runs]
        old = {(id(r.refs[0]), r.table): r for r in old_runs if r.refs}
        # A series still in the store keeps its prefix from the line it had (the old runs hold their refs, so an
        # id here cannot be a new object's).
        held = {id(ref): (line, n) for r in old_runs for ref, line, n in zip(r.refs, r.lines, r.plen, strict=True)}
        families = []
        for metric, refs in index.items():
            runs: list[_Run] = []
            start = 0
            for i in range(1, len(refs) + 1):
                if i == len(refs) or refs[i].table != refs[start].table:
                    part = refs[start:i]
                    prev = old.get((id(part[0]), part[0].table))
                    if prev is not None and prev.refs == part:
                        runs.append(prev)  # the same series, in the same columns: its lines stay good
                    else:
                        lines, plen = [], []
                        for r in part:
                            got = held.get(id(r))
                            prefix = got[0][:got[1]] if got is not None else _series_prefix(metric, r.labels)
                            lines.append(prefix)
                            plen.append(len(prefix))
                        cols = np.fromiter((r.col for r in part), dtype=np.int64, count=len(part))
                        runs.append(_Run(part[0].table, part, cols, plen, lines))
                    start = i
            families.append((metric, runs))
        self._plan = (version, families)
        return families

    def render(self) -> bytes:
        with self._lock:
            return self._render()

    def _render(self) -> bytes:
        import numpy as np

        # The plan before the values: a series added in between is not in the plan yet (shown next scrape),
        # whereas a plan newer than the values would name columns past their end.
        families = self._families()
        vectors = self.store.latest_vectors()
        out: list[str] = []
        for metric, runs in families:
            lines: list[str] = []
            for run in runs:
                vec = vectors.get(run.table)
                if vec is None or (len(run.cols) and int(run.cols.max()) >= len(vec[0])):
                    continue  # (a table emptied since the plan was made: nothing of it is live)
                live = vec[0][run.cols]
                if not live.any():
                    continue
                vals = vec[1][run.cols]
                bits = vals.view(np.uint64)
                have = run.lines
                changed = None if run.shown is None else np.flatnonzero(bits != run.shown)
                # (repr() is the spelling of finite values; format_value() that of NaN and ±Inf)
                fmt = repr if np.isfinite(vals).all() else format_value
                if changed is None or 2 * len(changed) > len(bits):
                    have = run.lines = [line[:n] + fmt(v)
                                        for line, n, v in zip(have, run.plen, vals.tolist(), strict=True)]
                elif len(changed):
                    plen = run.plen
                    for i, v in zip(changed.tolist(), vals[changed].tolist(), strict=True):
                        have[i] = have[i][:plen[i]] + fmt(v)
                run.shown = bits
                lines += have if live.all() else [have[i] for i in np.flatnonzero(live).tolist()]
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

