"""The store's sealed, compressed blocks: lossless, bit for bit; reads across block boundaries and the
retention floor equal a plain reference; column reuse, checkpoints and the remote_write cursor see the
same rows as before sealing."""

import json
import re

import numpy as np
import pytest

from cri_resmgr.export.remote_write import StoreCursor
from cri_resmgr.store import Sample, Store, checkpoint
from cri_resmgr.store.tsdb import Block


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)


def test_block_round_trips_every_kind_of_value_bit_for_bit():
    rng = np.random.default_rng(7)
    n = 200
    cols = [
        rng.random(n),                                        # noisy gauge: ~7 bytes
        np.cumsum(rng.integers(0, 5000, n)).astype(float),    # integer counter
        np.full(n, 42.0),                                     # constant
        np.full(n, np.nan),                                   # never written
        np.where(rng.random(n) < 0.3, np.nan, rng.normal(size=n)),  # gaps
        np.array([0.0, -0.0, np.inf, -np.inf, 5e-324, 1.7976931348623157e308] * 34)[:n],  # edge values
        np.cumsum(rng.random(n)) * 1e-3,                      # fractional counter
    ]
    V = np.stack(cols, axis=1)
    ts = 1.7e9 + np.cumsum(rng.uniform(0.9, 1.1, n))
    b = Block(1000, ts, V)
    assert np.array_equal(bits(b.ts), bits(ts))
    all_cols = np.arange(V.shape[1])
    assert np.array_equal(bits(b.columns(all_cols)), bits(V))
    for order in (np.array([6, 0, 3]), np.array([2]), np.array([5, 5, 1])):  # any subset, any order
        assert np.array_equal(bits(b.columns(order)), bits(V[:, order]))
    # a column added to the table after sealing reads as not written
    out = b.columns(np.array([1, 9]))
    assert np.array_equal(out[:, 0], V[:, 1]) and np.isnan(out[:, 1]).all()
    # the constant and the never-written columns cost no payload; the integer counter less than the noise
    assert b.width_of(2) == 0 and b.width_of(3) == 0
    assert b.width_of(1) < b.width_of(0) <= 8


def test_decimal_series_are_delta_coded_and_come_back_bit_for_bit():
    """Values that are k / 10**d exactly (as the collectors compute CPU seconds from µs or ns counters)
    are stored as integer steps; anything else, or anything that would not come back exactly, stays XOR."""
    from cri_resmgr.store.tsdb import _XOR

    rng = np.random.default_rng(9)
    n = 256
    ns = np.cumsum(rng.integers(0, 10**9, n))
    cols = [
        ns / 1e9,                                              # cgroup v1 cpuacct.usage (ns) in seconds
        np.cumsum(rng.integers(0, 10**6, n)) / 1e6,             # cgroup v2 usage_usec in seconds
        (1 << 30) - np.cumsum(rng.integers(0, 64, n)) * 4096.0,  # a falling byte gauge
        np.cumsum(rng.integers(-5, 6, n)).astype(float),        # steps of both signs
        np.arange(n, dtype=float) * 3,                          # a steady counter: constant step
        np.where(np.arange(n) % 2 == 0, -0.0, 0.0),             # -0.0 cannot come back from an integer
        2.0 ** 60 + np.arange(n) * 2.0 ** 10,                   # beyond 2**53: not delta-coded
        np.cumsum(rng.integers(0, 100, n)) / 1e3,               # milli
        np.r_[np.arange(n - 1, dtype=float), np.nan],           # a gap: in the bitmap, delta-coded
        np.arange(n) * 0.1,                                     # not k/10**d exactly for any d tried
    ]
    V = np.stack(cols, axis=1)
    b = Block(0, np.arange(n, dtype=float), V)
    assert np.array_equal(bits(b.columns(np.arange(V.shape[1]))), bits(V))
    for c in range(V.shape[1]):
        out = np.empty((1, n))  # the single-series read
        b.decode_into(np.array([c]), out)
        assert np.array_equal(bits(out[0]), bits(V[:, c])), c
    mode = [b.groups[g][3] if g >= 0 else _XOR for g in b.gid]
    assert mode[0] == 9 and mode[1] == 6 and mode[7] == 3 and mode[3] == mode[4] == 0, mode  # [2]: either
    assert mode[5] == mode[6] == _XOR and mode[8] == 0, mode
    assert b.gapcols.tolist() == [8]
    assert b.width_of(0) <= 4 and b.width_of(1) <= 3 and b.width_of(4) == 0
    # and a block round-trips through its checkpoint form
    arrays, meta = b.to_arrays("x_")
    b2 = Block.from_arrays(arrays, "x_", json.loads(json.dumps(meta)))
    assert np.array_equal(bits(b2.columns(np.arange(V.shape[1]))), bits(V))


def test_single_row_block():
    b = Block(0, np.array([5.0]), np.array([[1.5, np.nan]]))
    assert b.ts.tolist() == [5.0]
    assert b.columns(np.array([0]))[0, 0] == 1.5 and np.isnan(b.columns(np.array([1]))[0, 0])


class Reference:
    """What the store must return: every row kept in plain Python lists."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.rows = []  # (t, {col_key: value})

    def add(self, t, row):
        self.rows.append((t, dict(row)))
        self.rows = self.rows[-self.capacity:]

    def series(self, key, start, end):
        pts = [(t, r[key]) for t, r in self.rows if start <= t <= end and key in r]
        return np.array([p[0] for p in pts]), np.array([p[1] for p in pts])


@pytest.mark.parametrize("retention,n", [(700, 1500), (300, 257), (2000, 600)])
def test_reads_across_blocks_and_the_retention_floor_equal_a_reference(retention, n):
    s = Store(retention_seconds=retention)
    ref = Reference(s.table("t", 1.0).capacity)
    rng = np.random.default_rng(retention)
    for i in range(n):
        t = 1000.0 + i
        row = {}
        for c in range(6):
            if c == 5 and i % 3:  # a series written in one row of three
                continue
            if c == 4 and i < n // 2:  # a series that appears half-way
                continue
            row[c] = float(i * (c + 1)) if c < 3 else float(rng.normal())
        ref.add(t, row)
        s.append("t", t, [Sample("m", {"c": str(c)}, v) for c, v in row.items()])
    tab = s.tables["t"]
    assert tab.count == min(n, tab.capacity)
    if n > tab.block_rows:
        assert tab.blocks, "rows beyond one block are sealed"
    for start, end in ((0, 1e9), (1000 + n - 300.5, 1000 + n - 10), (1000 + n - 1, 1e9), (0, 1000 + n / 2),
                       (1000 + n - 256, 1000 + n - 255)):
        for c in range(6):
            r = s.select("m", [])
            sref = next(x for x in r if x.label_dict["c"] == str(c))
            ts, vs = s.raw(sref, start, end)
            rts, rvs = ref.series(c, start, end)
            assert np.array_equal(ts, rts) and np.array_equal(vs, rvs), (start, end, c)
    # the matrix read keeps the not-written cells as NaN, row for row
    cols = [next(x for x in s.select("m", []) if x.label_dict["c"] == str(c)).col for c in range(6)]
    ts, V = s.raw_matrix("t", cols, 0, 1e9)
    assert np.array_equal(ts, [t for t, _ in ref.rows])
    expect = np.array([[r.get(c, np.nan) for c in range(6)] for _, r in ref.rows])
    assert np.array_equal(V, expect, equal_nan=True)
    latest = {ref_.label_dict["c"]: v for ref_, _, v in s.latest("m", max_age_rows=5)}
    assert latest["0"] == float((n - 1) * 1)


def test_a_reused_column_does_not_show_the_old_series_rows():
    s = Store(retention_seconds=100)
    for i in range(150):  # "old" written for 40 rows, then never again: its column is reclaimed
        samples = [Sample("keep", {}, float(i))] + ([Sample("old", {}, 1000.0 + i)] if i < 40 else [])
        s.append("t", float(i), samples)
    assert not s.select("old")
    for i in range(150, 160):
        s.append("t", float(i), [Sample("keep", {}, float(i)), Sample("new", {}, -float(i))])
    tab = s.tables["t"]
    new = s.select("new")[0]
    assert new.col == 1, "the freed column was reused"
    ts, vs = s.raw(new, 0, 1e9)
    assert ts.tolist() == [float(i) for i in range(150, 160)] and vs.tolist() == [-float(i) for i in range(150, 160)]
    assert tab.since[new.col] == 150


def _fill(s, n, t0=1000.0):
    for i in range(n):
        s.append("t", t0 + i, [Sample("m_total", {"c": str(c)}, float(i * (c + 1))) for c in range(4)]
                 + [Sample("g", {}, float(np.sin(i)))])


def _all_reads(s):
    out = {}
    for m in s.metrics():
        for r in s.select(m):
            ts, vs = s.raw(r, 0, 1e12)
            out[(m, r.labels)] = (ts.tolist(), vs.tolist())
    return out


def test_checkpoint_keeps_sealed_blocks_and_hot_rows_exactly(tmp_path):
    s = Store(retention_seconds=1000)
    _fill(s, 1300)  # 1001 kept: some sealed blocks, some hot rows, floor inside a block
    tab = s.tables["t"]
    assert tab.blocks and tab.hot_n
    checkpoint.save(s, tmp_path)
    s2 = Store(retention_seconds=1000)
    res = checkpoint.restore(s2, tmp_path)
    assert res.restored and res.series == 5, res
    assert _all_reads(s2) == _all_reads(s)
    assert [(r.metric, v) for r, _, v in s2.latest(max_age_rows=0)] == [(r.metric, v) for r, _, v in s.latest()]
    # and it goes on writing where it stopped
    _fill(s2, 10, t0=1000.0 + 1300)
    ts, vs = s2.raw(s2.select("m_total", [])[0], 0, 1e12)
    assert ts[-1] == 1000.0 + 1309 and len(ts) == s2.tables["t"].capacity


def test_checkpoint_restored_under_a_shorter_retention_keeps_the_newest_rows(tmp_path):
    s = Store(retention_seconds=1000)
    _fill(s, 1300)
    checkpoint.save(s, tmp_path)
    s2 = Store(retention_seconds=100)
    assert checkpoint.restore(s2, tmp_path).restored
    ts, _ = s2.raw(s2.select("g")[0], 0, 1e12)
    assert ts.tolist() == [1000.0 + i for i in range(1300 - 101, 1300)]


def test_format_1_checkpoint_still_restores(tmp_path):
    ts = np.arange(50, dtype=float) + 1000
    vals = np.stack([ts * 2, np.full(50, np.nan)], axis=1)
    vals[-5:, 1] = 7.0
    meta = {"version": 1, "saved_at": 0, "tables": [{"name": "t", "capacity": 3601, "last_age": [0, 0],
            "keys": [["a_total", [["c", "0"]]], ["b", []]]}]}
    with open(tmp_path / checkpoint.FILENAME, "wb") as f:
        np.savez(f, t0_ts=ts, t0_vals=vals, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    s = Store()
    res = checkpoint.restore(s, tmp_path)
    assert res.restored and res.series == 2, res
    got = _all_reads(s)
    assert got[("a_total", (("c", "0"),))] == (ts.tolist(), (ts * 2).tolist())
    assert got[("b", ())] == (ts[-5:].tolist(), [7.0] * 5)


def test_corrupt_block_arrays_are_reported_and_skipped(tmp_path):
    s = Store(retention_seconds=1000)
    _fill(s, 600)
    path = checkpoint.save(s, tmp_path)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    victim = next(k for k in arrays if re.fullmatch(r"t0_b0_g\d+", k))
    arrays[victim] = arrays[victim][..., :-3]  # a payload cut short
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    s2 = Store()
    res = checkpoint.restore(s2, tmp_path)
    assert not res.restored and "payload shape" in res.error, res
    assert s2.series_count == 0 and not s2.tables


def test_remote_write_cursor_reads_each_row_once_across_seals():
    s = Store(retention_seconds=2000)
    cur = StoreCursor(s)
    seen = []
    for chunk in (100, 300, 5, 600):  # the hot block seals (256 rows) between and inside reads
        t0 = 1000.0 + len(seen) // 2
        for i in range(chunk):
            s.append("t", t0 + i, [Sample("a", {}, t0 + i), Sample("b", {}, -(t0 + i))])
        got, lost = cur.read()
        assert lost == 0
        seen += got
    a = [q.value for q in seen if q.key[0] == "a"]
    assert a == [1000.0 + i for i in range(1005)]
    assert all(q.timestamp_ms == int(round(abs(q.value) * 1000)) for q in seen)


def test_integer_counters_compress_to_a_few_bytes_per_sample():
    """What the store is for: counters, byte gauges, flags. A full hour at 1 s of 200 containers' worth of
    such series stays well under the 8 bytes a raw float64 sample takes."""
    s = Store(retention_seconds=3600)
    rng = np.random.default_rng(3)
    ncont = 50
    usage_us = np.zeros(ncont, dtype=np.int64)
    mem = rng.integers(1 << 20, 1 << 30, ncont).astype(float)
    keys = ([("cpu_usage_seconds_total", {"c": str(i)}) for i in range(ncont)]
            + [("memory_usage_bytes", {"c": str(i)}) for i in range(ncont)]
            + [("throttled_periods_total", {"c": str(i)}) for i in range(ncont)]
            + [("up", {"c": str(i)}) for i in range(ncont)])
    h = s.prepare("t", keys)
    thr = np.zeros(ncont)
    for r in range(3600):
        usage_us += rng.integers(0, 500_000, ncont)  # CPU seconds as the cgroup collector makes them
        usage = usage_us / 1e6
        mem += rng.integers(-4096, 4096, ncont) * 4096.0
        thr += rng.integers(0, 2, ncont)
        h = s.write(h, 1000.0 + r, np.concatenate([usage, mem, thr, np.ones(ncont)]))
    tab = s.tables["t"]
    per_sample = tab.nbytes() / (tab.count * len(keys))  # with the uncompressed hot block
    sealed = sum(b.nbytes() for b in tab.blocks) / (sum(b.n for b in tab.blocks) * len(keys))
    assert per_sample < 3.5 and sealed < 2.5, (per_sample, sealed)
    cpu_col = s.select("cpu_usage_seconds_total")[0].col
    assert tab.blocks[0].width_of(cpu_col) <= 3  # integer microsecond deltas, not 8-byte float XORs
    ts, V = s.raw_matrix("t", list(range(len(keys))), 0, 1e9)
    assert np.array_equal(V[-1], np.concatenate([usage, mem, thr, np.ones(ncont)]))


def test_select_from_the_inverted_index_equals_matching_every_series():
    """Equality matchers go through an inverted index that must follow series as they come and go."""
    from cri_resmgr.store import parse_matchers

    rng = np.random.default_rng(5)
    s = Store(retention_seconds=30)
    queries = ['c="1"', 'c="1",p="a"', 'p="b",c!="2"', 'c=~"1|3",p="a"', 'p=""', 'q="x"', 'c="9"', "", 'p!="a"']

    def brute(matchers):
        return [r for r in s.series_by_metric().get("m", []) if all(m.matches(r.label_dict) for m in matchers)]

    for i in range(120):
        live = [c for c in range(8) if rng.random() < (0.9 if i < 60 else 0.3)]  # series stop, are reclaimed
        samples = [Sample("m", {"c": str(c), **({"p": "ab"[c % 2]} if c != 7 else {})}, float(i)) for c in live]
        s.append("t", float(i), samples)
        if i % 7 == 0:
            for q in queries:
                ms = parse_matchers(q) if q else []
                assert s.select("m", ms) == brute(ms), (i, q)
