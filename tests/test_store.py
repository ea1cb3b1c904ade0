import numpy as np
import pytest

from cri_resmgr.store import (
    Columns,
    Matcher,
    QueryError,
    Sample,
    Store,
    checkpoint,
    heatmap,
    parse_matchers,
    query_range,
)
from cri_resmgr.store.query import AGGS, _bucket_bounds

# -- per-series references of the matrix versions the product uses (aggregate_matrix, rate_matrix) ------------------


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


def fill(store, n=100, t0=1000.0, series=3, table="t", metric="m_total", f=lambda i, c: i * (c + 1)):
    for i in range(n):
        store.append(table, t0 + i, [Sample(metric, {"cpu": str(c)}, f(i, c)) for c in range(series)], 1.0)


def brute(ts, vs, times, step, fn):
    out = []
    for t in times:
        sel = vs[(ts > t - step) & (ts <= t)]
        out.append(fn(sel) if len(sel) else np.nan)
    return np.array(out)


@pytest.mark.parametrize("agg,fn", [("avg", np.mean), ("sum", np.sum), ("max", np.max), ("min", np.min),
                                     ("last", lambda a: a[-1])])
def test_aggregation_matches_brute_force(agg, fn):
    rng = np.random.default_rng(1)
    ts = np.sort(rng.uniform(0, 100, 500))
    vs = rng.normal(size=500)
    times = np.arange(0, 101, 7.0)
    np.testing.assert_allclose(aggregate(ts, vs, times, 7.0, agg), brute(ts, vs, times, 7.0, fn), equal_nan=True)


def test_empty_buckets_are_nan():
    out = aggregate(np.array([5.0]), np.array([1.0]), np.array([1.0, 5.0, 9.0]), 2.0, "avg")
    assert np.isnan(out[0]) and out[1] == 1.0 and np.isnan(out[2])


def test_counter_reset_yields_positive_rate():
    ts = np.arange(10.0)
    vs = np.array([0, 10, 20, 30, 5, 15, 25, 35, 45, 55], dtype=float)  # reset to 0 before t=4
    r = rate(ts, vs, np.array([9.0]), 10.0)
    # increases: 10,10,10,5,10,10,10,10,10 = 85 over 9 s
    assert r[0] == pytest.approx(85 / 9)
    assert (rate(ts, vs, np.arange(1.0, 10.0), 1.0) >= 0).all()


def test_rate_irregular_sampling_is_true_average():
    ts = np.array([0.0, 1.0, 3.0, 4.0])
    vs = np.array([0.0, 2.0, 6.0, 8.0])  # 2/s throughout
    assert rate(ts, vs, np.array([4.0]), 4.0)[0] == pytest.approx(2.0)


def test_retention_wraps_and_keeps_only_recent():
    s = Store(retention_seconds=50)
    fill(s, n=200)
    tab = s.tables["t"]
    assert tab.count == tab.capacity == 51
    ts, vs = s.raw(s.select("m_total")[0], 0, 1e9)
    assert ts[0] == 1000 + 200 - 51 and ts[-1] == 1199 and np.all(np.diff(ts) > 0)
    assert vs[-1] == 199


def test_label_matching_operators():
    s = Store()
    fill(s, n=3, series=12)
    assert {r.label_dict["cpu"] for r in s.select("m_total", parse_matchers('{cpu=~"1.*"}'))} == {"1", "10", "11"}
    assert len(s.select("m_total", parse_matchers("cpu!=3"))) == 11
    assert len(s.select("m_total", parse_matchers('cpu!~"[0-9]"'))) == 2
    assert s.select("m_total", parse_matchers('cpu="nope"')) == []


@pytest.mark.parametrize("bad", ['{cpu="0"', "cpu", 'cpu=~"("', "1cpu=2", 'a="b" c="d"'])
def test_bad_matchers_raise_query_error(bad):
    with pytest.raises(QueryError):
        parse_matchers(bad)


def test_query_range_rate_and_heatmap():
    s = Store()
    fill(s, n=100)
    times, res = query_range(s, "m_total", [], 1050, 1090, 10, fn="rate")
    assert list(times) == [1050, 1060, 1070, 1080, 1090]
    assert [r.labels["cpu"] for r in res] == ["0", "1", "2"]
    np.testing.assert_allclose(res[2].values, 3.0)
    rows, times, m = heatmap(s, "m_total", "cpu", 1050, 1090, 10)
    assert rows == ["0", "1", "2"] and m.shape == (3, 5)
    np.testing.assert_allclose(m[:, 0], [1, 2, 3])


def test_heatmap_combines_rows():
    s = Store()
    for i in range(20):
        s.append("t", 1000 + i, [Sample("g", {"cpu": str(c), "core": str(c // 2)}, float(c)) for c in range(4)])
    rows, _, m = heatmap(s, "g", "core", 1010, 1019, 1, combine="avg")
    assert rows == ["0", "1"] and m[0, 0] == 0.5 and m[1, 0] == 2.5
    rows, _, m = heatmap(s, "g", "core", 1010, 1019, 1, combine="sum")
    assert m[1, 0] == 5.0


def test_query_parameter_errors():
    s = Store()
    fill(s, n=5)
    with pytest.raises(QueryError, match="step"):
        query_range(s, "m_total", [], 0, 10, 0)
    with pytest.raises(QueryError, match="before start"):
        query_range(s, "m_total", [], 10, 0, 1)
    with pytest.raises(QueryError, match="agg"):
        query_range(s, "m_total", [], 0, 10, 1, agg="median")
    with pytest.raises(QueryError, match="exceeds"):
        query_range(s, "m_total", [], 0, 1e9, 1)
    with pytest.raises(QueryError, match="by must be"):
        heatmap(s, "m_total", "socket", 0, 10, 1)


def test_vanished_series_columns_are_reclaimed():
    s = Store(retention_seconds=10)
    s.append("t", 0, [Sample("g", {"c": "old"}, 1.0)])
    for i in range(1, 40):
        s.append("t", i, [Sample("g", {"c": "new"}, 1.0)])
    assert [r.label_dict["c"] for r in s.select("g")] == ["new"]
    assert s.series_count == 1


def test_latest_skips_stale_series():
    s = Store()
    s.append("t", 1, [Sample("g", {"c": "a"}, 1.0), Sample("g", {"c": "b"}, 2.0)])
    s.append("t", 2, [Sample("g", {"c": "a"}, 3.0)])
    assert [(r.label_dict["c"], v) for r, _, v in s.latest("g")] == [("a", 3.0)]


def test_max_series_drops_and_counts():
    s = Store(max_series=2)
    s.append("t", 1, [Sample("g", {"c": str(i)}, 1.0) for i in range(5)])
    assert s.series_count == 2 and s.dropped_samples == 3


def test_prepared_write_fast_path_equals_append():
    s = Store()
    keys = [("g", {"c": str(i)}) for i in range(4)]
    h = s.prepare("t", keys)
    for i in range(10):
        h = s.write(h, 100 + i, np.arange(4) * i)
    ts, vs = s.raw(s.select("g", parse_matchers("c=3"))[0], 0, 1e9)
    assert list(vs) == [3 * i for i in range(10)]


def test_checkpoint_round_trip(tmp_path):
    s = Store()
    fill(s, n=30)
    s.append("other", 5000, [Sample("g", {"x": "1"}, 7.0)])
    checkpoint.save(s, tmp_path)
    s2 = Store()
    res = checkpoint.restore(s2, tmp_path)
    assert res.restored and res.series == 4
    for ref in s.select("m_total"):
        a = s.raw(ref, 0, 1e9)
        b = s2.raw(s2.select("m_total", parse_matchers(f'cpu="{ref.label_dict["cpu"]}"'))[0], 0, 1e9)
        np.testing.assert_array_equal(a[0], b[0]) and np.testing.assert_array_equal(a[1], b[1])
    assert [v for _, _, v in s2.latest("g")] == [7.0]
    # writing continues after restore
    s2.append("t", 2000, [Sample("m_total", {"cpu": "0"}, 1.0)])
    assert s2.raw(s2.select("m_total", parse_matchers("cpu=0"))[0], 0, 1e9)[1][-1] == 1.0


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_checkpoint_is_reported_and_skipped(tmp_path, damage):
    s = Store()
    fill(s, n=30)
    path = checkpoint.save(s, tmp_path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00junk" * 100, "empty": b""}[damage])
    s2 = Store()
    res = checkpoint.restore(s2, tmp_path)
    assert not res.restored and "unreadable" in res.error
    assert s2.series_count == 0 and not path.exists()
    assert list(tmp_path.glob("store.npz.corrupt-*"))


def test_checkpoint_restore_into_smaller_retention(tmp_path):
    s = Store(retention_seconds=100)
    fill(s, n=100)
    checkpoint.save(s, tmp_path)
    s2 = Store(retention_seconds=10)
    assert checkpoint.restore(s2, tmp_path).restored
    ts, vs = s2.raw(s2.select("m_total")[0], 0, 1e9)
    assert len(ts) == 11 and ts[-1] == 1099


@pytest.mark.parametrize("agg", ["avg", "sum", "max", "min", "last"])
def test_matrix_aggregation_equals_per_series_with_gaps(agg):
    from cri_resmgr.store.query import aggregate_matrix

    rng = np.random.default_rng(2)
    ts = np.arange(200.0)
    V = rng.normal(size=(200, 5))
    V[rng.random((200, 5)) < 0.3] = np.nan  # series missing in some rows
    times = np.arange(3.0, 200, 6.0)
    M = aggregate_matrix(ts, V, times, 6.0, agg)
    for c in range(5):
        ok = ~np.isnan(V[:, c])
        np.testing.assert_allclose(M[:, c], aggregate(ts[ok], V[ok, c], times, 6.0, agg), equal_nan=True)


def test_matrix_rate_equals_per_series_and_handles_reset():
    from cri_resmgr.store.query import rate_matrix

    ts = np.arange(30.0)
    V = np.stack([np.arange(30.0) * 2, np.r_[np.arange(15.0) * 3, np.arange(15.0) * 3]], axis=1)
    times = np.arange(5.0, 30, 5.0)
    M = rate_matrix(ts, V, times, 5.0)
    for c in range(2):
        np.testing.assert_allclose(M[:, c], rate(ts, V[:, c], times, 5.0))
    assert (M >= 0).all()


def test_window_by_label_sums_what_query_range_gives_per_series():
    """The rebalancer's vector read: per container, the sum over its series of query_range's one value for the
    window (rates with a counter reset and gaps, averages), series without the label or the value left out."""
    from cri_resmgr.store.query import Matcher, window_by_label

    rng = np.random.default_rng(4)
    s = Store(retention_seconds=3600)
    counts = {}
    for r in range(200):
        t = 1000.0 + 2 * r
        samples = []
        for c in range(12):
            for cache in ("0", "1"):
                lab = {"container_id": f"c{c}", "cache_id": cache, "scope": "total" if c % 3 else "local"}
                if c == 5 and r % 4 == 1:
                    continue  # gaps
                k = (c, cache)
                counts[k] = 0.0 if (c == 7 and r == 150) else counts.get(k, 0.0) + float(rng.integers(0, 1000))
                samples.append(Sample("bytes_total", lab, counts[k]))
                samples.append(Sample("occupancy", lab, float(rng.integers(0, 1 << 20))))
        samples.append(Sample("bytes_total", {"cache_id": "0"}, float(r)))  # no container_id
        s.append("rdt", t, samples, 2.0)
    now = 1000.0 + 2 * 199
    for metric, fn, matchers in (("bytes_total", "rate", []), ("bytes_total", "rate", [Matcher("scope", "=", "total")]),
                                 ("occupancy", "raw", []), ("absent", "raw", [])):
        _, series = query_range(s, metric, matchers, now, now, 60.0, agg="avg", fn=fn)
        expect: dict[str, float] = {}
        for sr in series:
            cid, v = sr.labels.get("container_id"), float(sr.values[-1])
            if cid and not np.isnan(v):
                expect[cid] = expect.get(cid, 0.0) + v
        got = window_by_label(s, metric, matchers, now, 60.0, fn)
        assert got == pytest.approx(expect, rel=1e-12), (metric, matchers)
        assert (len(got) > 0) == (metric != "absent")


def test_window_by_label_follows_series_that_come_go_and_reuse_a_column():
    """window_by_label keeps which columns it reads until the store's set of series changes (Store.by_index): a
    container whose series appear later is read from then on, one whose column was reclaimed (and reused by
    another series) is no longer read, and a series' values are read afresh every call."""
    from cri_resmgr.store.query import window_by_label

    s = Store(retention_seconds=40)  # 20 rows at 2 s: a series not written for a ring is reclaimed
    t = 1000.0

    def write(cids, v):
        nonlocal t
        t += 2.0
        s.append("cg", t, [Sample("occ", {"container_id": c}, v) for c in cids], 2.0)

    for _ in range(3):
        write(["a", "b"], 5.0)
    assert window_by_label(s, "occ", [], t, 10.0) == {"a": 5.0, "b": 5.0}
    version = s.index_version
    write(["a", "b"], 7.0)
    assert s.index_version == version and window_by_label(s, "occ", [], t, 2.0) == {"a": 7.0, "b": 7.0}
    write(["a", "b", "c"], 9.0)  # a new container
    assert window_by_label(s, "occ", [], t, 2.0) == {"a": 9.0, "b": 9.0, "c": 9.0}
    col_b = next(r.col for r in s.select("occ") if r.label_dict["container_id"] == "b")
    for _ in range(25):  # b stops: after a ring its column is reclaimed, then taken by d
        write(["a", "c"], 1.0)
    write(["a", "c", "d"], 3.0)
    cols = {r.label_dict["container_id"]: r.col for r in s.select("occ")}
    assert "b" not in cols and cols["d"] == col_b
    assert window_by_label(s, "occ", [], t, 2.0) == {"a": 3.0, "c": 3.0, "d": 3.0}


def test_by_index_keeps_a_value_until_the_index_changes_and_a_bounded_number_of_them():
    from cri_resmgr.store.tsdb import BY_INDEX_KEEP

    s = Store()
    calls = []

    def compute():
        calls.append(1)
        return len(s.select("m"))

    s.append("t", 1.0, [Sample("m", {"k": "1"}, 1.0)])
    assert s.by_index("n", compute) == 1 and s.by_index("n", compute) == 1 and len(calls) == 1
    s.append("t", 2.0, [Sample("m", {"k": "1"}, 2.0)])  # a value, not a series: kept
    assert s.by_index("n", compute) == 1 and len(calls) == 1
    s.append("t", 3.0, [Sample("m", {"k": "2"}, 1.0)])  # a new series: computed again
    assert s.by_index("n", compute) == 2 and len(calls) == 2
    for i in range(BY_INDEX_KEEP + 10):
        s.by_index(("other", i), lambda: 0)
    assert len(s._by_index) == BY_INDEX_KEEP and "n" not in s._by_index


def test_the_index_holds_no_object_per_series_and_makes_refs_when_asked():
    """The store and its exposition keep column numbers and the store's label tuples, not a SeriesRef per series
    (at 20 k series the refs took ~1.5 MB); a reader still gets refs, equal for the same series."""
    import gc

    from cri_resmgr.export.exposition import Exposition
    from cri_resmgr.store.tsdb import SeriesRef

    s = Store(retention_seconds=600)
    keys = [("m", {"container_id": f"c{i}"}) for i in range(500)] + [("n", {"cpu": str(i)}) for i in range(4)]
    for r in range(3):
        s.append_columns("t", 1000.0 + r, Columns(keys, np.arange(len(keys), dtype=float) + r), 1.0)
    s.append("u", 1000.0, [Sample("n", {"cpu": "9"}, 7.0)], 1.0)  # the same metric in a second table
    e = Exposition(s)
    text = e.render().decode()
    assert text.count("\nm{") == 500 and 'n{cpu="9"} 7.0' in text
    gc.collect()
    assert sum(type(o) is SeriesRef for o in gc.get_objects()) == 0
    assert s.count("m") == 500 and s.count("n") == 5 and s.count("absent") == 0 and s.series_count == 505
    refs = s.select("n")
    want = [("t", (("cpu", str(i)),)) for i in range(4)] + [("u", (("cpu", "9"),))]
    assert [(r.table, r.labels) for r in refs] == want
    assert s.select("m", [Matcher("container_id", "=", "c7")]) == [SeriesRef("m", (("container_id", "c7"),), "t", 7)]
    assert {ref for ref, _, _ in s.latest("n")} == set(refs)


def test_tables_hold_no_key_tuple_per_column_and_the_index_finds_columns():
    """A table names its columns with two lists (metric, the store's label tuple), not a (metric, labels) tuple
    each beside a key -> column map (at 20 k series ~2 MB the index held again); the index resolves new keys."""
    import gc

    s = Store(retention_seconds=600)
    keys = [("m", {"container_id": f"c{i}"}) for i in range(500)]
    s.append_columns("t", 1000.0, Columns(keys, np.ones(500)), 1.0)
    tab = s.tables["t"]
    gc.collect()
    held = [o for o in gc.get_objects() if type(o) is tuple and len(o) == 2 and o[0] == "m" and type(o[1]) is tuple]
    assert held == []
    s.append("t", 1001.0, [Sample("m", {"container_id": "c3"}, 2.0)], 1.0)  # the same series, found by the index
    assert s.series_count == 500 and tab.ncols == 500
    assert tab.keys[3] == ("m", (("container_id", "c3"),)) == tab.key(3)
    ref = s.select("m", [Matcher("container_id", "=", "c3")])[0]
    assert s.raw(ref, 0, 2000)[1].tolist() == [1.0, 2.0]


def test_a_series_written_to_two_tables_holds_one_column():
    """Written to one table and then another, alternately: the series is the one written last and the other
    table's column is freed, so neither table takes a column per write."""
    s = Store(retention_seconds=600)
    for r in range(50):
        s.append("a" if r % 2 else "b", 1000.0 + r, [Sample("m", {"c": "1"}, float(r))], 1.0)
    assert s.series_count == 1 and s.count("m") == 1
    assert [r.table for r in s.select("m")] == ["a"]
    for name in ("a", "b"):
        tab = s.tables[name]
        assert tab.ncols == 1 and len([k for k in tab.keys if k is not None]) == (name == "a")


def test_a_checkpoint_naming_a_series_twice_indexes_it_once():
    """Restored keys that name one series in two columns of a table, and again in another table: one series,
    the one indexed last, and the other columns free (before: counted three times)."""
    s = Store(retention_seconds=600)
    lk = (("c", "1"),)
    state = {"last_seq": np.array([0, 0]), "last_val": np.array([1.0, 2.0]), "last_t": np.array([1.0, 1.0]),
             "since": np.zeros(2, dtype=np.int64)}
    hot = np.array([[1.0, 2.0]])
    assert s.restore_table("t", 600, [("m", lk), ("m", lk)], 1, [], np.array([1.0]), hot, state) == 2
    assert s.series_count == 1 and s.tables["t"].keys == [None, ("m", lk)]
    s.restore_table("u", 600, [("m", lk), ("n", lk)], 1, [], np.array([1.0]), hot, state)
    assert s.series_count == 2 and s.tables["t"].keys == [None, None]
    assert [(r.table, r.col) for r in s.select("m")] == [("u", 0)]
