"""Queries over the store: label matching, range with step and aggregation, counter rates, heatmaps.

Time buckets follow Prometheus' convention: the point at time ``t`` summarises samples in
``(t - step, t]``. Points are ``start, start+step, ... ≤ end``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .tsdb import SeriesRef, Store

Agg = Literal["avg", "max", "min", "sum", "last"]
AGGS: tuple[str, ...] = ("avg", "max", "min", "sum", "last")
MAX_POINTS = 11_000  # like Prometheus: refuse queries that would return absurdly many points per series


class QueryError(ValueError):
    """A query that cannot be answered as asked; the message says which parameter is wrong."""


@dataclass(frozen=True)
class Matcher:
    label: str
    op: Literal["=", "!=", "=~", "!~"]
    value: str

    def matches(self, labels: dict[str, str]) -> bool:
        v = labels.get(self.label, "")
        if self.op == "=":
            return v == self.value
        if self.op == "!=":
            return v != self.value
        hit = re.fullmatch(self.value, v) is not None
        return hit if self.op == "=~" else not hit


_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*(?:"((?:[^"\\]|\\.)*)"|([^,}"]*))\s*')


def parse_matchers(text: str) -> list[Matcher]:
    """Parse ``{a="x", b=~"y.*"}`` or ``a=x,b!=y``. Raises QueryError naming the bad part."""
    t = text.strip()
    if t.startswith("{"):
        if not t.endswith("}"):
            raise QueryError(f"matcher {text!r}: missing closing brace")
        t = t[1:-1]
    out: list[Matcher] = []
    pos = 0
    while pos < len(t):
        m = _MATCHER.match(t, pos)
        if not m:
            raise QueryError(f"matcher {text!r}: cannot parse at {t[pos:]!r}; expected label=\"value\"")
        label, op, quoted, bare = m.groups()
        value = bytes(quoted, "utf-8").decode("unicode_escape") if quoted is not None else (bare or "").strip()
        if op in ("=~", "!~"):
            try:
                re.compile(value)
            except re.error as e:
                raise QueryError(f"matcher {text!r}: bad regular expression {value!r}: {e}") from None
        out.append(Matcher(label, op, value))  # type: ignore[arg-type]
        pos = m.end()
        if pos < len(t):
            if t[pos] != ",":
                raise QueryError(f"matcher {text!r}: expected ',' at {t[pos:]!r}")
            pos += 1
    return out


def step_times(start: float, end: float, step: float) -> np.ndarray:
    if not np.isfinite(start) or not np.isfinite(end):
        raise QueryError("start and end must be finite numbers")
    if step <= 0:
        raise QueryError(f"step must be > 0, got {step}")
    if end < start:
        raise QueryError(f"end ({end}) is before start ({start})")
    n = int(np.floor((end - start) / step + 1e-9)) + 1
    if n > MAX_POINTS:
        raise QueryError(f"{n} points per series exceeds the limit of {MAX_POINTS}; use a larger step")
    return start + step * np.arange(n)


def _bucket_bounds(ts: np.ndarray, times: np.ndarray, step: float) -> tuple[np.ndarray, np.ndarray]:
    lo = np.searchsorted(ts, times - step, side="right")
    hi = np.searchsorted(ts, times, side="right")
    return lo, hi


def aggregate(ts: np.ndarray, vs: np.ndarray, times: np.ndarray, step: float, agg: str) -> np.ndarray:
    """Aggregate samples into the buckets ending at ``times``; empty buckets are NaN."""
    if agg not in AGGS:
        raise QueryError(f"agg must be one of {', '.join(AGGS)}, got {agg!r}")
    out = np.full(len(times), np.nan)
    if len(ts) == 0:
        return out
    lo, hi = _bucket_bounds(ts, times, step)
    nonempty = hi > lo
    if not nonempty.any():
        return out
    if agg == "last":
        out[nonempty] = vs[hi[nonempty] - 1]
        return out
    if agg in ("sum", "avg"):
        csum = np.concatenate(([0.0], np.cumsum(vs)))
        sums = csum[hi] - csum[lo]
        if agg == "sum":
            out[nonempty] = sums[nonempty]
        else:
            out[nonempty] = sums[nonempty] / (hi - lo)[nonempty]
        return out
    # min/max: buckets tile time, so consecutive non-empty buckets are contiguous in the sample array
    # (idx_hi[i] == idx_lo[i+1]) and reduceat over their starts reduces exactly each bucket, except the
    # last one, which reduceat extends to the end of the array.
    ufunc = np.maximum if agg == "max" else np.minimum
    idx_lo, idx_hi = lo[nonempty], hi[nonempty]
    res = ufunc.reduceat(vs, idx_lo)
    if idx_hi[-1] < len(vs):
        res[-1] = ufunc.reduce(vs[idx_lo[-1]:idx_hi[-1]])
    out[nonempty] = res
    return out


def counter_increases(ts: np.ndarray, vs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-interval increases of a counter, handling resets: a drop means the counter restarted from
    zero (process restart, container re-created), so the increase is the new value itself — the same
    rule as Prometheus' rate(). Returns (end times, increases, interval lengths)."""
    if len(vs) < 2:
        return ts[:0], vs[:0], ts[:0]
    d = np.diff(vs)
    reset = d < 0
    d[reset] = vs[1:][reset]
    return ts[1:], d, np.diff(ts)


def rate(ts: np.ndarray, vs: np.ndarray, times: np.ndarray, step: float) -> np.ndarray:
    """Per-second rate in each bucket: the increases whose intervals end in the bucket, divided by the
    length of those intervals (so irregular sampling gives the true average rate)."""
    out = np.full(len(times), np.nan)
    te, inc, dt = counter_increases(ts, vs)
    if len(te) == 0:
        return out
    lo, hi = _bucket_bounds(te, times, step)
    ci = np.concatenate(([0.0], np.cumsum(inc)))
    cd = np.concatenate(([0.0], np.cumsum(dt)))
    span = cd[hi] - cd[lo]
    ok = (hi > lo) & (span > 0)
    out[ok] = (ci[hi] - ci[lo])[ok] / span[ok]
    return out


@dataclass
class SeriesResult:
    labels: dict[str, str]
    values: np.ndarray


def aggregate_matrix(ts: np.ndarray, V: np.ndarray, times: np.ndarray, step: float, agg: str) -> np.ndarray:
    """:func:`aggregate` for many series sharing a time axis at once (columns of ``V``, NaN = no sample).
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
    """:func:`rate` for the columns of ``V`` at once. Intervals with a missing sample at either end are
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
    out = []
    # A rate at the first bucket needs the sample just before it.
    lookback = step if fn == "raw" else 2 * step
    by_table: dict[str, list[SeriesRef]] = {}
    for ref in store.select(metric, matchers):
        by_table.setdefault(ref.table, []).append(ref)
    for table, refs in by_table.items():
        ts, V = store.raw_matrix(table, [r.col for r in refs], start - lookback, end)
        M = rate_matrix(ts, V, times, step) if fn == "rate" else aggregate_matrix(ts, V, times, step, agg)
        for i, ref in enumerate(refs):
            out.append(SeriesResult(ref.label_dict, M[:, i]))
    out.sort(key=lambda r: sorted(r.labels.items()))
    return times, out


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
        fn = "rate" if metric.endswith("_total") else "raw"
    times, series = query_range(store, metric, matchers or [], start, end, step, agg=agg, fn=fn)
    names: list[str | None] = [row_label(sr.labels, by) for sr in series]
    rows = sorted({n for n in names if n is not None}, key=_row_sort_key)
    matrix = np.full((len(rows), len(times)), np.nan)
    if not rows:
        return rows, times, matrix
    pos = {r: i for i, r in enumerate(rows)}
    keep = [i for i, n in enumerate(names) if n is not None]
    gid = np.array([pos[names[i]] for i in keep])
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


def select(store: Store, metric: str, matchers: list[Matcher]) -> list[SeriesRef]:
    return store.select(metric, matchers)
