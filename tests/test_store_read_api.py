"""The store's read API (what exposition, the heatmap catalogue, remote_write and checkpoints use instead of its
index, tables and lock) and its one place of series registration."""

from __future__ import annotations

import numpy as np

from cri_resmgr.store import Sample, Store, checkpoint


def _fill(s: Store, rows: int, t0: float = 1000.0) -> None:
    for r in range(rows):
        s.append("t", t0 + r, [Sample("m", {"cpu": str(c)}, float(r * 10 + c)) for c in range(3)])


def test_series_by_metric_is_a_snapshot_in_first_written_order():
    s = Store()
    s.append("t", 1.0, [Sample("b", {"x": "2"}, 1.0), Sample("a", {}, 2.0), Sample("b", {"x": "1"}, 3.0)])
    snap = s.series_by_metric()
    assert [r.labels for r in snap["b"]] == [(("x", "2"),), (("x", "1"),)] and len(snap["a"]) == 1
    s.append("t", 2.0, [Sample("c", {}, 1.0)])
    assert "c" not in snap and s.has_metric("c") and not s.has_metric("nope")


def test_rows_since_returns_each_row_once_and_counts_what_the_ring_overwrote():
    s = Store(retention_seconds=9)  # a 10-row ring at 1 s
    _fill(s, 4)
    cursor = s.row_counts()
    assert cursor == {"t": 4}
    assert s.rows_since(cursor) == []
    _fill(s, 3, t0=2000.0)
    (new,) = s.rows_since(cursor)
    assert (new.table, new.start, new.first, new.end) == ("t", 4, 4, 7)
    assert new.ts.tolist() == [2000.0, 2001.0, 2002.0]
    cols = [new.keys.index(("m", (("cpu", str(c)),))) for c in range(3)]
    np.testing.assert_array_equal(new.values[:, cols], [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0], [20.0, 21.0, 22.0]])
    _fill(s, 25, t0=3000.0)  # more than the ring holds: the oldest unread rows are gone
    (late,) = s.rows_since({"t": new.end})
    assert late.start == 7 and late.end == 32 and late.first == late.end - s.tables["t"].count > late.start
    assert late.ts[-1] == 3024.0 and len(late.ts) == late.end - late.first


def test_max_series_is_enforced_in_one_place_for_append_prepare_and_restore(tmp_path):
    s = Store(max_series=2)
    s.append("t", 1.0, [Sample("m", {"i": "0"}, 1.0), Sample("m", {"i": "1"}, 1.0), Sample("m", {"i": "2"}, 1.0)])
    assert s.series_count == 2 and s.dropped_samples == 1
    h = s.prepare("u", [("n", {"i": "0"})])
    assert h.cols.tolist() == [-1] and s.series_count == 2  # prepare drops at the limit too
    checkpoint.save(s, tmp_path)
    small = Store(max_series=1)
    res = checkpoint.restore(small, tmp_path)
    assert res.restored and res.series == 1 and small.series_count == 1  # adopt_series refused the second
    assert len(small.select("m")) == 1


def test_clear_forgets_everything_and_registration_starts_over():
    s = Store()
    _fill(s, 2)
    s.clear()
    assert s.series_count == 0 and s.metrics() == [] and s.row_counts() == {}
    _fill(s, 1)
    assert s.series_count == 3 and [r.label_dict["cpu"] for r in s.select("m")] == ["0", "1", "2"]
