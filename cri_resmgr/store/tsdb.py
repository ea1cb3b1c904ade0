"""Embedded time-series store: numpy ring buffers grouped into tables.

A *table* holds the series written together by one source (a collector run): one ring of timestamps
shared by all its series, and a 2-D ring of values (rows = time, columns = series). Sharing the time
axis keeps a sample at ~8 bytes and turns a collector's write and a heatmap's read into vector
operations. A series that is not written in a row holds NaN there. Columns whose series have not been
written for a whole retention period are reused.

Thread safety: one lock per store; writes are short (a row assignment), queries copy what they read.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from .query import Matcher

Labels = tuple[tuple[str, str], ...]


def labels_key(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


@dataclass(frozen=True)
class SeriesRef:
    metric: str
    labels: Labels
    table: str
    col: int

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)


class Table:
    def __init__(self, name: str, capacity: int, columns: int = 16):
        if capacity < 2:
            raise ValueError("table capacity must be at least 2 rows")
        self.name = name
        self.capacity = capacity
        self.ts = np.zeros(capacity, dtype=np.float64)
        self.vals = np.full((capacity, max(columns, 1)), np.nan, dtype=np.float64)
        self.head = 0  # next row to write
        self.count = 0  # rows filled (≤ capacity)
        self.seq = 0  # rows ever written
        self.keys: list[tuple[str, Labels] | None] = []
        self.col_of: dict[tuple[str, Labels], int] = {}
        self.last_seq = np.full(self.vals.shape[1], -1, dtype=np.int64)  # seq of a column's last write
        self.free: list[int] = []
        self.generation = 0  # bumped whenever columns are reclaimed
        self.fast_col: dict[tuple, int] = {}

    # -- columns -----------------------------------------------------------------------------------
    def _grow(self) -> None:
        old = self.vals.shape[1]
        vals = np.full((self.capacity, old * 2), np.nan, dtype=np.float64)
        vals[:, :old] = self.vals
        self.vals = vals
        last = np.full(old * 2, -1, dtype=np.int64)
        last[:old] = self.last_seq
        self.last_seq = last

    def column(self, key: tuple[str, Labels]) -> tuple[int, bool]:
        col = self.col_of.get(key)
        if col is not None:
            return col, False
        if self.free:
            col = self.free.pop()
            self.keys[col] = key
        else:
            col = len(self.keys)
            if col >= self.vals.shape[1]:
                self._grow()
            self.keys.append(key)
        self.vals[:, col] = np.nan
        self.last_seq[col] = -1
        self.col_of[key] = col
        return col, True

    def reclaim(self) -> list[tuple[str, Labels]]:
        """Free columns not written for a whole ring; return their keys."""
        horizon = self.seq - self.capacity
        gone = []
        for col, key in enumerate(self.keys):
            if key is not None and self.last_seq[col] < horizon:
                gone.append(key)
                del self.col_of[key]
                self.keys[col] = None
                self.free.append(col)
        if gone:
            self.generation += 1
            self.fast_col.clear()
        return gone

    # -- rows --------------------------------------------------------------------------------------
    def write_row(self, t: float, cols: np.ndarray, values: np.ndarray) -> None:
        row = self.head
        self.ts[row] = t
        self.vals[row, :] = np.nan
        self.vals[row, cols] = values
        self.last_seq[cols] = self.seq
        self.seq += 1
        self.head = (row + 1) % self.capacity
        self.count = min(self.count + 1, self.capacity)

    def order(self) -> np.ndarray:
        """Row indices oldest → newest."""
        if self.count < self.capacity:
            return np.arange(self.count)
        return (np.arange(self.capacity) + self.head) % self.capacity

    def window(self, start: float, end: float) -> np.ndarray:
        """Row indices with start ≤ ts ≤ end, oldest first (timestamps are written in order)."""
        rows = self.order()
        ts = self.ts[rows]
        lo = np.searchsorted(ts, start, side="left")
        hi = np.searchsorted(ts, end, side="right")
        return rows[lo:hi]

    def last_row(self) -> int | None:
        if self.count == 0:
            return None
        return (self.head - 1) % self.capacity


@dataclass(frozen=True)
class RowHandle:
    table: str
    cols: np.ndarray
    generation: int
    keys: list
    interval_seconds: float


class Sample(NamedTuple):
    """One value of one series. A NamedTuple: collectors create many of these per run."""

    metric: str
    labels: Mapping[str, str]
    value: float


class Store:
    def __init__(self, retention_seconds: float = 3600.0, max_series: int = 200_000):
        self.retention_seconds = retention_seconds
        self.max_series = max_series
        self.tables: dict[str, Table] = {}
        self.index: dict[str, dict[Labels, SeriesRef]] = {}
        self.dropped_samples = 0
        self._series = 0
        self._lock = threading.RLock()

    # -- writing -----------------------------------------------------------------------------------
    def table(self, name: str, interval_seconds: float) -> Table:
        with self._lock:
            t = self.tables.get(name)
            cap = max(2, int(math.ceil(self.retention_seconds / max(interval_seconds, 1e-3))) + 1)
            if t is None:
                t = self.tables[name] = Table(name, cap)
            return t

    def append(self, table: str, t: float, samples: Iterable[Sample], interval_seconds: float = 1.0) -> None:
        """Write one row: every sample of ``samples`` at time ``t`` into ``table``."""
        with self._lock:
            tab = self.table(table, interval_seconds)
            last = tab.last_row()
            if last is not None and t <= tab.ts[last]:
                # Time must advance within a table (wall clock stepped back?): keep order by nudging.
                t = float(np.nextafter(tab.ts[last], np.inf))
            cols: list[int] = []
            vals: list[float] = []
            fast = tab.fast_col  # (metric, labels as given) -> column: skips sorting for known series
            for s in samples:
                fk = (s.metric, tuple(s.labels.items()))
                col = fast.get(fk)
                if col is None:
                    lk = labels_key(s.labels)
                    key = (s.metric, lk)
                    col = tab.col_of.get(key)
                    if col is None:
                        if self._series >= self.max_series:
                            self.dropped_samples += 1
                            continue
                        col, _ = tab.column(key)
                        self.index.setdefault(s.metric, {})[lk] = SeriesRef(s.metric, lk, table, col)
                        self._series += 1
                    fast[fk] = col
                cols.append(col)
                vals.append(s.value)
            tab.write_row(t, np.asarray(cols, dtype=np.int64), np.asarray(vals, dtype=np.float64))
            if tab.seq % max(1, tab.capacity // 4) == 0:
                self._reclaim(tab)

    def prepare(self, table: str, keys: list[tuple[str, Mapping[str, str]]],
                interval_seconds: float = 1.0) -> "RowHandle":
        """Resolve a fixed list of series to columns once, for :meth:`write` (the vector fast path)."""
        with self._lock:
            tab = self.table(table, interval_seconds)
            cols = []
            for metric, labels in keys:
                lk = labels_key(labels)
                col = tab.col_of.get((metric, lk))
                if col is None:
                    if self._series >= self.max_series:
                        cols.append(-1)
                        continue
                    col, _ = tab.column((metric, lk))
                    self.index.setdefault(metric, {})[lk] = SeriesRef(metric, lk, table, col)
                    self._series += 1
                cols.append(col)
            return RowHandle(table, np.asarray(cols, dtype=np.int64), tab.generation, list(keys), interval_seconds)

    def write(self, handle: "RowHandle", t: float, values: np.ndarray) -> "RowHandle":
        """Write one row for a prepared handle; returns the handle to use next time."""
        with self._lock:
            tab = self.tables.get(handle.table)
            if tab is None or tab.generation != handle.generation:
                handle = self.prepare(handle.table, handle.keys, handle.interval_seconds)
                tab = self.tables[handle.table]
            last = tab.last_row()
            if last is not None and t <= tab.ts[last]:
                t = float(np.nextafter(tab.ts[last], np.inf))
            values = np.asarray(values, dtype=np.float64)
            ok = handle.cols >= 0
            if not ok.all():
                self.dropped_samples += int((~ok).sum())
            tab.write_row(t, handle.cols[ok], values[ok])
            if tab.seq % max(1, tab.capacity // 4) == 0:
                self._reclaim(tab)
            return handle

    def _reclaim(self, tab: Table) -> None:
        for metric, lk in tab.reclaim():
            series = self.index.get(metric)
            if series and lk in series:
                del series[lk]
                self._series -= 1
                if not series:
                    del self.index[metric]

    # -- reading -----------------------------------------------------------------------------------
    @property
    def series_count(self) -> int:
        return self._series

    def metrics(self) -> list[str]:
        with self._lock:
            return sorted(self.index)

    def select(self, metric: str, matchers: Iterable["Matcher"] = ()) -> list[SeriesRef]:
        matchers = list(matchers)
        with self._lock:
            refs = list(self.index.get(metric, {}).values())
        return [r for r in refs if all(m.matches(r.label_dict) for m in matchers)]

    def raw(self, ref: SeriesRef, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """Samples of one series with start ≤ t ≤ end, NaN (not written) removed."""
        with self._lock:
            tab = self.tables[ref.table]
            rows = tab.window(start, end)
            ts = tab.ts[rows]
            vs = tab.vals[rows, ref.col]
        ok = ~np.isnan(vs)
        return ts[ok], vs[ok]

    def raw_matrix(self, table: str, cols: list[int], start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows with start ≤ t ≤ end of several columns of one table: (ts, values[rows, cols]), NaN kept."""
        cols_a = np.asarray(cols, dtype=np.int64)
        with self._lock:
            tab = self.tables[table]
            rows = tab.window(start, end)
            if len(rows) == 0:
                return tab.ts[rows], np.empty((0, len(cols_a)))
            # The window is at most two contiguous runs of the ring: slice them instead of fancy-indexing rows.
            brk = np.flatnonzero(np.diff(rows) != 1)
            runs = np.split(rows, brk + 1)
            ts = np.concatenate([tab.ts[r[0]:r[-1] + 1] for r in runs])
            V = np.concatenate([tab.vals[r[0]:r[-1] + 1, cols_a] for r in runs])
            return ts, V

    def latest_vectors(self, max_age_rows: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per table: (live mask, latest value) for every column, computed as vectors."""
        out = {}
        with self._lock:
            for name, tab in self.tables.items():
                n = len(tab.keys)
                if tab.count == 0 or n == 0:
                    continue
                last = tab.last_seq[:n]
                age = tab.seq - 1 - last
                live = (last >= 0) & (age <= max_age_rows) & (age < tab.count)
                rows = (tab.head - 1 - np.where(live, age, 0)) % tab.capacity
                out[name] = (live, tab.vals[rows, np.arange(n)])
        return out

    def latest(self, metric: str | None = None, max_age_rows: int = 0) -> list[tuple[SeriesRef, float, float]]:
        """(ref, time, value) for every live series: written in its table's newest row."""
        out = []
        with self._lock:
            metrics = [metric] if metric else list(self.index)
            for m in metrics:
                for ref in self.index.get(m, {}).values():
                    tab = self.tables[ref.table]
                    last = tab.last_row()
                    if last is None or tab.last_seq[ref.col] < tab.seq - 1 - max_age_rows:
                        continue
                    row = (tab.head - 1 - (tab.seq - 1 - tab.last_seq[ref.col])) % tab.capacity
                    out.append((ref, float(tab.ts[row]), float(tab.vals[row, ref.col])))
        return out

    def span(self) -> tuple[float, float] | None:
        with self._lock:
            lo = hi = None
            for tab in self.tables.values():
                if tab.count == 0:
                    continue
                order = tab.order()
                a, b = float(tab.ts[order[0]]), float(tab.ts[order[-1]])
                lo = a if lo is None else min(lo, a)
                hi = b if hi is None else max(hi, b)
            return None if lo is None else (lo, hi)

    # lock for checkpointing
    @property
    def lock(self) -> threading.RLock:
        return self._lock

