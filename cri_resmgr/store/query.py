"""Queries over the store: label matching, range with step and aggregation, counter rates, heatmaps.

Time buckets follow Prometheus' convention: the point at time ``t`` summarises samples in
``(t - step, t]``. Points are ``start, start+step, ... ≤ end``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from .. import metrics as M
from .tsdb import SeriesRef, Store

if TYPE_CHECKING:
    import re2

Agg = Literal["avg", "max", "min", "sum", "last"]
AGGS: tuple[str, ...] = ("avg", "max", "min", "sum", "last")
MAX_POINTS = 11_000  # like Prometheus: refuse queries that would return absurdly many points per series


# Series × steps one response may hold. Each point costs about 61 bytes of peak memory while the answer is
# built (measured, issue 12), so this caps one request near 30 MB whatever the store holds.
MAX_RESPONSE_POINTS = 500_000
# Longest regular expression accepted in a matcher (bytes of the pattern as given). RE2 bounds the work of a
# match by the input's length, and the compiled program's size by its memory budget; this bounds compiling.
MAX_REGEX_BYTES = 4096
# RE2's memory budget for one compiled matcher (its DFA cache and program): patterns that need more fail to
# compile and are answered 400.
_RE2_MAX_MEM = 8 << 20


class QueryError(ValueError):
    """A query that cannot be answered as asked; the message says which parameter is wrong."""


@functools.cache
def _re2():
    """The re2 module and its options, imported on the first regular expression (about 1.5 MB of RSS that an
    agent nobody queries with a regex does not need)."""
    import re2

    o = re2.Options()
    o.max_mem = _RE2_MAX_MEM
    o.log_errors = False
    return re2, o


def compile_regex(pattern: str, param: str = "match[]") -> re2._Regexp:
    """Compile a label regular expression as Prometheus does: RE2 syntax, fully anchored, ``.`` also
    matching a newline (``^(?s:pattern)$``, see prometheus/model/labels/regexp.go). RE2 runs in time linear
    in the input, so no pattern can stall the agent. Raises QueryError naming ``param``."""
    if len(pattern.encode()) > MAX_REGEX_BYTES:
        raise QueryError(f"{param}: regular expression of {len(pattern.encode())} bytes is longer than the "
                         f"limit of {MAX_REGEX_BYTES}")
    re2, options = _re2()
    try:
        return re2.compile(f"^(?s:{pattern})$", options)
    except re2.error as e:
        raise QueryError(f"{param}: bad regular expression {pattern!r}: {e}") from None


@dataclass(frozen=True)
class Matcher:
    label: str
    op: Literal["=", "!=", "=~", "!~"]
    value: str
    _rx: re2._Regexp | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.op in ("=~", "!~"):
            object.__setattr__(self, "_rx", compile_regex(self.value))

    def matches(self, labels: Mapping[str, str]) -> bool:
        v = labels.get(self.label, "")
        if self.op == "=":
            return v == self.value
        if self.op == "!=":
            return v != self.value
        assert self._rx is not None
        hit = self._rx.search(v) is not None
        return hit if self.op == "=~" else not hit


_SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}
_HEX = frozenset("0123456789abcdefABCDEF")


def unquote_go(body: str, quote: str, param: str = "match[]") -> str:
    """Unescape the inside of a Go string literal as Go's ``strconv.Unquote`` does (the PromQL lexer uses it;
    https://go.dev/ref/spec#String_literals): ``\\a \\b \\f \\n \\r \\t \\v \\\\``, the quote itself (``\\"`` in
    double, ``\\'`` in single quotes), ``\\NNN`` octal and ``\\xNN`` bytes, ``\\uNNNN`` and ``\\UNNNNNNNN`` code
    points. Other characters stand for their UTF-8 bytes. Raises QueryError naming ``param``; the result
    must be valid UTF-8."""
    if "\\" not in body:
        return body
    out = bytearray()
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c != "\\":
            j = body.find("\\", i)
            j = n if j < 0 else j
            out += body[i:j].encode("utf-8", "surrogatepass")
            i = j
            continue
        if i + 1 >= n:
            raise QueryError(f"{param}: string ends inside an escape sequence")
        e = body[i + 1]
        if e in _SIMPLE_ESCAPES:
            out += _SIMPLE_ESCAPES[e].encode()
            i += 2
        elif e == quote:
            out += e.encode()
            i += 2
        elif e in "01234567":
            digits = body[i + 1:i + 4]
            if len(digits) < 3 or any(d not in "01234567" for d in digits) or int(digits, 8) > 255:
                raise QueryError(f"{param}: bad octal escape \\{digits!s} (expected three octal digits ≤ 377)")
            out.append(int(digits, 8))
            i += 4
        elif e in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[e]
            digits = body[i + 2:i + 2 + width]
            if len(digits) < width or any(d not in _HEX for d in digits):
                raise QueryError(f"{param}: bad escape \\{e}{digits} (expected {width} hex digits)")
            v = int(digits, 16)
            if e == "x":
                out.append(v)
            else:
                if v > 0x10FFFF or 0xD800 <= v <= 0xDFFF:
                    raise QueryError(f"{param}: escape \\{e}{digits} is not a Unicode code point")
                out += chr(v).encode()
            i += 2 + width
        else:
            raise QueryError(f"{param}: unknown escape sequence \\{e}")
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise QueryError(f"{param}: the escaped string is not valid UTF-8") from None


_LABEL = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*")
_BARE = re.compile(r'[^,}"\'`]*')


def _string_end(t: str, pos: int, quote: str) -> int:
    """Index of the closing quote of the literal opened at ``t[pos]``, or -1."""
    i = pos + 1
    while i < len(t):
        if t[i] == "\\" and quote != "`":
            i += 2
            continue
        if t[i] == quote:
            return i
        i += 1
    return -1


def parse_matchers(text: str, param: str = "match[]") -> list[Matcher]:
    """Parse ``{a="x", b=~"y.*"}`` or ``a=x,b!=y``. Values are PromQL string literals (double, single or
    back quotes, Go escapes) or bare words. Raises QueryError naming ``param`` and the bad part."""
    t = text.strip()
    if t.startswith("{"):
        if not t.endswith("}"):
            raise QueryError(f"{param}: matcher {text!r}: missing closing brace")
        t = t[1:-1]
    out: list[Matcher] = []
    pos = 0
    while pos < len(t):
        m = _LABEL.match(t, pos)
        if not m:
            raise QueryError(f"{param}: matcher {text!r}: cannot parse at {t[pos:]!r}; expected label=\"value\"")
        label, op = m.group(1), m.group(2)
        pos = m.end()
        if pos < len(t) and t[pos] in "\"'`":
            q = t[pos]
            end = _string_end(t, pos, q)
            if end < 0:
                raise QueryError(f"{param}: matcher {text!r}: unterminated string at {t[pos:]!r}")
            body = t[pos + 1:end]
            value = body if q == "`" else unquote_go(body, q, param)
            pos = end + 1
        else:
            b = _BARE.match(t, pos)
            assert b is not None  # the pattern matches the empty string
            value = b.group(0).strip()
            pos = b.end()
        if op in ("=~", "!~"):
            compile_regex(value, param)
        out.append(Matcher(label, op, value))  # type: ignore[arg-type]
        while pos < len(t) and t[pos].isspace():
            pos += 1
        if pos < len(t):
            if t[pos] != ",":
                raise QueryError(f"{param}: matcher {text!r}: expected ',' at {t[pos:]!r}")
            pos += 1
    return out


# Prometheus' time range: millisecond timestamps in an int64 (its minTime/maxTime).
MAX_TIME_SECONDS = float((1 << 63) // 1000)


def step_times(start: float, end: float, step: float) -> np.ndarray:
    for name, v in (("start", start), ("end", end), ("step", step)):
        if not math.isfinite(v):
            raise QueryError(f"{name}: must be a finite number of seconds, got {v}")
        if abs(v) > MAX_TIME_SECONDS:
            raise QueryError(f"{name}: {v} is outside the representable time range of ±{MAX_TIME_SECONDS:.0f} s")
    if step <= 0:
        raise QueryError(f"step: must be > 0, got {step}")
    if end < start:
        raise QueryError(f"end: ({end}) is before start ({start})")
    span = end - start  # may overflow to inf for finite ends far apart
    # Far-apart finite ends overflow end - start; dividing first keeps the count finite.
    n_float = (span / step if math.isfinite(span) else end / step - start / step) + 1e-9
    if not n_float < MAX_POINTS:
        raise QueryError(f"step: the number of points per series from start to end exceeds the limit of "
                         f"{MAX_POINTS}; use a larger step "
                         f"or a shorter start..end")
    n = int(math.floor(n_float)) + 1
    return start + step * np.arange(n)


def check_response_points(series: int, steps: int) -> None:
    """Refuse an answer of more than :data:`MAX_RESPONSE_POINTS` points before computing it."""
    if series * steps > MAX_RESPONSE_POINTS:
        raise QueryError(
            f"match[]/step: {series} series x {steps} steps = {series * steps} points is more than the limit of "
            f"{MAX_RESPONSE_POINTS} per response; narrow the query with match[] matchers (fewer series), "
            f"a larger step or a shorter start..end")


def _bucket_bounds(ts: np.ndarray, times: np.ndarray, step: float) -> tuple[np.ndarray, np.ndarray]:
    lo = np.searchsorted(ts, times - step, side="right")
    hi = np.searchsorted(ts, times, side="right")
    return lo, hi


@dataclass
class SeriesResult:
    labels: dict[str, str]
    values: np.ndarray


def aggregate_matrix(ts: np.ndarray, V: np.ndarray, times: np.ndarray, step: float, agg: str) -> np.ndarray:
    """Aggregation for many series sharing a time axis at once (columns of ``V``, NaN = no sample).
    Returns an array of shape (len(times), columns)."""
    if agg not in AGGS:
        raise QueryError(f"agg must be one of {', '.join(AGGS)}, got {agg!r}")
    out = np.full((len(times), V.shape[1]), np.nan)
    if len(ts) == 0 or V.shape[1] == 0:
        return out
    lo, hi = _bucket_bounds(ts, times, step)
    valid = ~np.isnan(V)
    if agg in ("sum", "avg"):
        # Buckets tile time, so consecutive non-empty buckets are contiguous row ranges and
        # add.reduceat over their starts sums exactly each bucket (row-wise adds: cache friendly).
        nonempty = hi > lo
        if not nonempty.any():
            return out
        idx_lo, idx_hi = lo[nonempty], hi[nonempty]
        # The store hands out column-major matrices (it decodes a column at a time): reduce each column's
        # contiguous run then, instead of across strided rows. ``ax`` is the time axis of W.
        col_major = V.flags.f_contiguous and not V.flags.c_contiguous
        W, Wv, ax = (V.T, valid.T, 1) if col_major else (V, valid, 0)
        Z = np.where(Wv, W, 0.0)
        sums = np.add.reduceat(Z, idx_lo, axis=ax)
        cnt = np.add.reduceat(Wv.astype(np.int32), idx_lo, axis=ax)
        if idx_hi[-1] < len(ts):
            tail = slice(idx_lo[-1], idx_hi[-1])
            np.moveaxis(sums, ax, 0)[-1] = np.moveaxis(Z, ax, 0)[tail].sum(axis=0)
            np.moveaxis(cnt, ax, 0)[-1] = np.moveaxis(Wv, ax, 0)[tail].sum(axis=0)
        if col_major:
            sums, cnt = sums.T, cnt.T
        with np.errstate(invalid="ignore", divide="ignore"):
            res = sums if agg == "sum" else sums / cnt
        out[nonempty] = np.where(cnt > 0, res, np.nan)
        return out
    if agg == "last":
        idx = np.where(valid, np.arange(len(ts))[:, None], -1)
        last = np.maximum.accumulate(idx, axis=0)
        li = last[np.maximum(hi - 1, 0)]
        ok = (li >= lo[:, None]) & (hi[:, None] > 0)
        cols = np.broadcast_to(np.arange(V.shape[1]), li.shape)
        return np.where(ok, V[np.maximum(li, 0), cols], np.nan)
    nonempty = hi > lo
    if not nonempty.any():
        return out
    ufunc = np.fmax if agg == "max" else np.fmin  # fmax/fmin skip NaN; all-NaN stays NaN
    idx_lo, idx_hi = lo[nonempty], hi[nonempty]
    res = ufunc.reduceat(V, idx_lo, axis=0)
    if idx_hi[-1] < len(ts):
        res[-1] = ufunc.reduce(V[idx_lo[-1]:idx_hi[-1]], axis=0)
    out[nonempty] = res
    return out


def rate_matrix(ts: np.ndarray, V: np.ndarray, times: np.ndarray, step: float) -> np.ndarray:
    """Per-second rate in each bucket for the columns of ``V`` at once: the increases whose intervals end in the
    bucket over the length of those intervals; a drop is a counter reset (the increase is the new value, as in
    Prometheus' rate()). Intervals with a missing sample at either end are
    left out of both the increase and the time covered, so gaps do not bias the rate."""
    out = np.full((len(times), V.shape[1]), np.nan)
    if len(ts) < 2 or V.shape[1] == 0:
        return out
    inc = np.diff(V, axis=0)
    reset = inc < 0
    inc[reset] = V[1:][reset]
    ok = ~np.isnan(inc)
    zero = np.zeros((1, V.shape[1]))
    if ok.all():
        # No gaps (the common case: every series written in every row): the time covered is the same for all
        # columns, one 1-D cumsum instead of a matrix one.
        ci = np.concatenate((zero, np.cumsum(inc, axis=0)))
        cd = np.concatenate(([0.0], np.cumsum(np.diff(ts))))[:, None]
    else:
        dt = np.broadcast_to(np.diff(ts)[:, None], inc.shape)
        ci = np.concatenate((zero, np.cumsum(np.where(ok, inc, 0.0), axis=0)))
        cd = np.concatenate((zero, np.cumsum(np.where(ok, dt, 0.0), axis=0)))
    lo, hi = _bucket_bounds(ts[1:], times, step)
    span = cd[hi] - cd[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(span > 0, (ci[hi] - ci[lo]) / span, np.nan)


def query_range(
    store: Store, metric: str, matchers: list[Matcher], start: float, end: float, step: float,
    agg: str = "avg", fn: str = "raw",
) -> tuple[np.ndarray, list[SeriesResult]]:
    """``fn='rate'`` turns counters into per-second rates before bucketing (agg is then ignored).
    Series of one table are computed together as a matrix."""
    if fn not in ("raw", "rate"):
        raise QueryError(f"fn must be 'raw' or 'rate', got {fn!r}")
    if agg not in AGGS:
        raise QueryError(f"agg must be one of {', '.join(AGGS)}, got {agg!r}")
    times = step_times(start, end, step)
    # A rate at the first bucket needs the sample just before it.
    lookback = step if fn == "raw" else 2 * step
    by_table: dict[str, list[SeriesRef]] = {}
    refs_all = store.select(metric, matchers)
    check_response_points(len(refs_all), len(times))
    for ref in refs_all:
        by_table.setdefault(ref.table, []).append(ref)
    rows: list[tuple[SeriesRef, np.ndarray]] = []
    for table, refs in by_table.items():
        ts, V = store.raw_matrix(table, [r.col for r in refs], start - lookback, end)
        M = rate_matrix(ts, V, times, step) if fn == "rate" else aggregate_matrix(ts, V, times, step, agg)
        rows += [(ref, M[:, i]) for i, ref in enumerate(refs)]
    # By label pairs: a series' key is already its pairs in sorted order (tsdb.labels_key).
    rows.sort(key=lambda rv: rv[0].labels)
    out = [SeriesResult(ref.label_dict, v) for ref, v in rows]
    return times, out


def window_by_label(store: Store, metric: str, matchers: list[Matcher], end: float, window: float, fn: str = "raw",
                    label: str = "container_id") -> dict[str, float]:
    """Per value of ``label``: the sum over its series of each series' value in the window (end - window, end]
    (an average, or with ``fn='rate'`` a rate), as :func:`query_range` from ``end`` to ``end`` with step ``window``
    gives it, series without a value there and series without the label left out. Computed as a vector per table,
    without building a result per series: the rebalancer reads its inputs this way every round."""
    if fn not in ("raw", "rate"):
        raise QueryError(f"fn must be 'raw' or 'rate', got {fn!r}")
    times = step_times(end, end, window)
    lookback = window if fn == "raw" else 2 * window

    def columns() -> dict[str, tuple[list[int], list[str]]]:
        # The matchers are tried here on each series (whose labels are looked at anyway) rather than by
        # Store.select: its inverted index of the metric (~1.4 MB for 3,300 series) would be rebuilt whenever a
        # series comes or goes. Kept by the store until its set of series changes (1,000 containers: ~5 ms a call).
        by_table: dict[str, tuple[list[int], list[str]]] = {}
        for ref in store.select(metric):
            lab = dict(ref.labels)
            key = lab.get(label)
            if key and all(m.matches(lab) for m in matchers):
                cols, keys = by_table.setdefault(ref.table, ([], []))
                cols.append(ref.col)
                keys.append(key)
        return by_table

    out: dict[str, float] = {}
    by_table = store.by_index(("window_by_label", metric, tuple(matchers), label), columns)
    for table, (cols, keys) in by_table.items():
        ts, V = store.raw_matrix(table, cols, end - lookback, end)
        M = rate_matrix(ts, V, times, window) if fn == "rate" else aggregate_matrix(ts, V, times, window, "avg")
        for key, v in zip(keys, M[-1].tolist(), strict=True):
            if v == v:  # (NaN: no sample in the window)
                out[key] = out.get(key, 0.0) + v
    return out


HEATMAP_BY = ("cpu", "core", "numa_node", "package", "die", "container", "pod")


def row_label(labels: dict[str, str], by: str) -> str | None:
    """Row name for heatmaps; containers fall back to a short id, pods to their uid."""
    if by == "container":
        name = labels.get("container") or labels.get("container_id", "")[:12]
        ns, pod = labels.get("namespace", ""), labels.get("pod", "")
        if not name:
            return None
        return f"{ns}/{pod}/{name}" if pod else name
    if by == "pod":
        pod = labels.get("pod") or labels.get("pod_uid", "")
        if not pod:
            return None
        ns = labels.get("namespace", "")
        return f"{ns}/{pod}" if ns else pod
    v = labels.get(by)
    return v if v not in (None, "") else None


def _row_sort_key(name: str):
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def heatmap(
    store: Store, metric: str, by: str, start: float, end: float, step: float, agg: str = "avg",
    matchers: list[Matcher] | None = None, fn: str | None = None, combine: str = "sum",
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Matrix rows × times. Series that share a row value are combined with ``combine`` (sum for
    per-CPU counters grouped by core gives the core's total, avg gives the mean per thread).
    Counters (``*_total``) are turned into rates unless ``fn='raw'``."""
    if by not in HEATMAP_BY:
        raise QueryError(f"by must be one of {', '.join(HEATMAP_BY)}, got {by!r}")
    if combine not in ("sum", "avg", "max", "min"):
        raise QueryError(f"combine must be one of sum, avg, max, min, got {combine!r}")
    if fn is None:
        fn = M.default_fn(metric)
    times, series = query_range(store, metric, matchers or [], start, end, step, agg=agg, fn=fn)
    names: list[str | None] = [row_label(sr.labels, by) for sr in series]
    rows = sorted({n for n in names if n is not None}, key=_row_sort_key)
    matrix = np.full((len(rows), len(times)), np.nan)
    if not rows:
        return rows, times, matrix
    pos = {r: i for i, r in enumerate(rows)}
    keep = [i for i, n in enumerate(names) if n is not None]
    gid = np.array([pos[n] for n in names if n is not None])
    S = np.vstack([series[i].values for i in keep])  # series x times
    order = np.argsort(gid, kind="stable")
    S, gid = S[order], gid[order]
    starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    valid = ~np.isnan(S)
    cnt = np.add.reduceat(valid.astype(np.int32), starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        if combine in ("sum", "avg"):
            tot = np.add.reduceat(np.where(valid, S, 0.0), starts, axis=0)
            res = tot if combine == "sum" else tot / cnt
        else:
            res = (np.fmax if combine == "max" else np.fmin).reduceat(S, starts, axis=0)
    matrix[gid[starts]] = np.where(cnt > 0, res, np.nan)
    return rows, times, matrix

