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


def query_range(
    store: Store, metric: str, matchers: list[Matcher], start: float, end: float, step: float,
    agg: str = "avg", fn: str = "raw",
) -> tuple[np.ndarray, list[SeriesResult]]:
    """``fn='rate'`` turns counters into per-second rates before bucketing (agg is then ignored)."""
    if fn not in ("raw", "rate"):
        raise QueryError(f"fn must be 'raw' or 'rate', got {fn!r}")
    if agg not in AGGS:
        raise QueryError(f"agg must be one of {', '.join(AGGS)}, got {agg!r}")
    times = step_times(start, end, step)
    out = []
    # A rate at the first bucket needs the sample just before it.
    lookback = step if fn == "raw" else 2 * step
    for ref in store.select(metric, matchers):
        ts, vs = store.raw(ref, start - lookback, end)
        values = rate(ts, vs, times, step) if fn == "rate" else aggregate(ts, vs, times, step, agg)
        out.append(SeriesResult(ref.label_dict, values))
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
    groups: dict[str, list[np.ndarray]] = {}
    for s in series:
        name = row_label(s.labels, by)
        if name is None:
            continue
        groups.setdefault(name, []).append(s.values)
    rows = sorted(groups, key=_row_sort_key)
    matrix = np.full((len(rows), len(times)), np.nan)
    for i, r in enumerate(rows):
        stack = np.vstack(groups[r])
        with np.errstate(all="ignore"):
            allnan = np.all(np.isnan(stack), axis=0)
            if combine == "sum":
                v = np.nansum(stack, axis=0)
            elif combine == "avg":
                v = np.nanmean(stack, axis=0) if stack.shape[0] > 1 else stack[0]
            elif combine == "max":
                v = np.nanmax(stack, axis=0) if stack.shape[0] > 1 else stack[0]
            else:
                v = np.nanmin(stack, axis=0) if stack.shape[0] > 1 else stack[0]
        v = np.where(allnan, np.nan, v)
        matrix[i] = v
    return rows, times, matrix


def select(store: Store, metric: str, matchers: list[Matcher]) -> list[SeriesRef]:
    return store.select(metric, matchers)
