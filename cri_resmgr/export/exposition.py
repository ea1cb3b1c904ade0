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

# What the text below is (format 0.0.4), as the Content-Type of a scrape. A constant here rather than
# prometheus_client's CONTENT_TYPE_LATEST: importing the library for it cost the served agent ~1.8 MB of RSS, and
# its newer releases name format 1.0.0, which is not what this writer claims to write.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

if TYPE_CHECKING:  # the relay and the NRI plugin use the writers below without the store (numpy, ~100 ms)
    import numpy as np

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


_STRIDE = 5  # pieces per line in _Run.pieces: name, label head, label tail, value, newline


@dataclass
class _Run:
    """The series of one metric that live in one table: their label sets and columns, and their lines as last
    rendered from the values ``shown`` (a value is formatted again only when it changed). A line is kept as
    _STRIDE pieces in ``pieces`` (``_STRIDE * i`` onwards): the metric name, the label text in two parts
    (:class:`_LabelText`), the value and ``"\\n"``. The name is one string per metric and the label parts are
    shared by every series with the same container (or the same other labels), so a series holds only its value's
    text, itself shared by the series of equal value when a run is formatted whole: at 20 k series (1,000
    containers), lines held whole took ~6 MB, a text per label set ~2.5 MB, the two shared parts ~0.3 MB. Before
    the first scrape a value is empty."""

    table: str
    labels: list[_Labels]  # the store's own tuples (one per label set)
    cols: np.ndarray
    pieces: list[str]
    shown: np.ndarray | None = None  # uint64 bit patterns of the values the lines hold; None: not rendered yet


_CONTAINER_LABELS = frozenset(M.CONTAINER_LABELS)
_Labels = tuple[tuple[str, str], ...]


def _pairs_text(labels: Iterable[tuple[str, str]]) -> str:
    return ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)


def _split(labels: _Labels) -> tuple[_Labels, _Labels]:
    """A series' labels in the order they are written: the container's labels (:data:`metrics.CONTAINER_LABELS`)
    first, then the others, each part in the order given (the store's: sorted). The text format leaves the order
    free; this one lets the container's part of the text be shared by all its series (PSI's ``resource`` and
    ``kind``, RDT's ``domain`` come after it)."""
    ident = tuple(p for p in labels if p[0] in _CONTAINER_LABELS)
    rest = tuple(p for p in labels if p[0] not in _CONTAINER_LABELS) if len(ident) < len(labels) else ()
    return ident, rest


class _LabelText:
    """The ``{labels} `` text of a series as two shared parts: the head (``{`` and the container's labels, one
    string per container) and the tail (the other labels and ``} ``, one string per distinct rest: ``cpu="3"``,
    ``kind="some",resource="io"``), in the order of :func:`_split`."""

    def __init__(self) -> None:
        self._heads: dict[_Labels, str] = {}
        self._tails: dict[tuple[_Labels, bool], str] = {}
        self._kept = 0  # parts held after the last pruning

    def of(self, labels: _Labels) -> tuple[str, str]:
        if not labels:
            return "", " "
        ident, rest = _split(labels)
        head = self._heads.get(ident)
        if head is None:
            head = self._heads[ident] = "{" + _pairs_text(ident)
        tail = self._tails.get((rest, bool(ident)))
        if tail is None:
            tail = self._tails[(rest, bool(ident))] = ("," if ident and rest else "") + _pairs_text(rest) + "} "
        return head, tail

    def prune(self, used: Callable[[], Iterable[_Labels]]) -> None:
        """Forget the parts no series uses any more (containers gone), once they are twice as many as after the
        last pruning (the first call only takes the count)."""
        held = len(self._heads) + len(self._tails)
        if not self._kept or held <= 2 * self._kept + 1024:
            self._kept = self._kept or held
            return
        old_heads, old_tails = self._heads, self._tails
        self._heads, self._tails = {}, {}
        for labels in {id(lk): lk for lk in used()}.values():
            ident, rest = _split(labels)
            if ident in old_heads:
                self._heads[ident] = old_heads[ident]
            if (rest, bool(ident)) in old_tails:
                self._tails[(rest, bool(ident))] = old_tails[(rest, bool(ident))]
        self._kept = len(self._heads) + len(self._tails)


class Exposition:
    """Renders the store's live series and the direct samples. What each series' line starts with is worked out
    once per change of the store's index (:attr:`Store.index_version`), and a value is formatted again only when
    it changed since the last scrape: a scrape costs vector operations plus the series that changed."""

    def __init__(self, store: Store, direct: Callable[[], Iterable[DirectSample]] = lambda: ()):
        self.store = store
        self.direct = direct
        self._header: dict[str, str] = {}
        self._plan: tuple[int, list[tuple[str, list[_Run]]]] | None = None
        self._labels = _LabelText()
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
        version, index = store.versioned_columns()
        old = {} if self._plan is None else {(metric, r.table): r for metric, runs in self._plan[1] for r in runs}
        text = self._labels
        # per label set (the store's one tuple per set, alive while ``index`` is): its parts, for this build only
        memo: dict[int, tuple[str, str]] = {}
        families = []
        for metric, by_table in index.items():
            runs: list[_Run] = []
            for table, labels, cols in by_table:
                prev = old.get((metric, table))
                if prev is not None and np.array_equal(prev.cols, cols) and len(prev.labels) == len(labels) \
                        and all(a is b for a, b in zip(prev.labels, labels, strict=True)):
                    runs.append(prev)  # the same series, in the same columns: its lines stay good
                else:
                    pieces = [metric, "", "", "", "\n"] * len(labels)
                    parts = [memo.get(id(lk)) or memo.setdefault(id(lk), text.of(lk)) for lk in labels]
                    pieces[1::_STRIDE] = [h for h, _ in parts]
                    pieces[2::_STRIDE] = [t for _, t in parts]
                    runs.append(_Run(table, labels, cols, pieces))
            families.append((metric, runs))
        text.prune(lambda: (lk for by_table in index.values() for _, labels, _ in by_table for lk in labels))
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
            at = len(out)
            out.append("")  # the family's HELP and TYPE, once a line of it is live
            for run in runs:
                vec = vectors.get(run.table)
                if vec is None or (len(run.cols) and int(run.cols.max()) >= len(vec[0])):
                    continue  # (a table emptied since the plan was made: nothing of it is live)
                live = vec[0][run.cols]
                if not live.any():
                    continue
                vals = vec[1][run.cols]
                bits = vals.view(np.uint64)
                pieces = run.pieces
                changed = None if run.shown is None else np.flatnonzero(bits != run.shown)
                # (repr() is the spelling of finite values; format_value() that of NaN and ±Inf)
                fmt = repr if np.isfinite(vals).all() else format_value
                if changed is None or 2 * len(changed) > len(bits):
                    # equal values share one text (1,000 idle containers: 1.4 k distinct values in 20 k series,
                    # whose texts took ~1 MB), each formatted once
                    distinct, which = np.unique(bits, return_inverse=True)
                    texts = list(map(fmt, distinct.view(np.float64).tolist()))
                    pieces[3::_STRIDE] = [texts[i] for i in which.tolist()]
                elif len(changed):
                    for i, v in zip(changed.tolist(), vals[changed].tolist(), strict=True):
                        pieces[_STRIDE * i + 3] = fmt(v)
                run.shown = bits
                if live.all():
                    out += pieces
                else:
                    for i in np.flatnonzero(live).tolist():
                        out += pieces[_STRIDE * i:_STRIDE * (i + 1)]
            if len(out) > at + 1:
                out[at] = self._head(M.spec_of(metric))
            else:
                out.pop()
        direct: dict[str, list[tuple[list[tuple[str, str]], float]]] = {}
        specs: dict[str, M.MetricSpec] = {}
        for d in self.direct():
            specs[d.spec.name] = d.spec
            direct.setdefault(d.spec.name, []).append((sorted(d.labels.items()), d.value))
        out += [format_family(specs[name], rows) for name, rows in direct.items()]
        return "".join(out).encode()

