"""The vector write path (Store.append_columns) and the hot block sized by table width."""

import numpy as np
import pytest

from cri_resmgr.store import Columns, Sample, Store, checkpoint
from cri_resmgr.store.tsdb import BLOCK_ROWS, HOT_BLOCK_BYTES, MIN_BLOCK_ROWS, block_rows_for


def _all_series(s: Store) -> dict:
    """(metric, labels) -> (times, values) of every stored series, NaN (not written) removed."""
    out = {}
    for metric, refs in s.series_by_metric().items():
        for r in refs:
            out[(metric, r.labels)] = s.raw(r, 0, 1e12)
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        (ta, va), (tb, vb) = a[k], b[k]
        assert np.array_equal(ta.view(np.uint64), tb.view(np.uint64)), k
        assert np.array_equal(va.view(np.uint64), vb.view(np.uint64)), k  # bit for bit


def test_block_rows_shrink_with_width_to_a_floor():
    assert block_rows_for(16) == BLOCK_ROWS
    assert block_rows_for(HOT_BLOCK_BYTES // (8 * BLOCK_ROWS)) == BLOCK_ROWS
    wide = block_rows_for(13_000)
    assert MIN_BLOCK_ROWS <= wide < BLOCK_ROWS
    assert wide * 13_000 * 8 <= max(HOT_BLOCK_BYTES, MIN_BLOCK_ROWS * 13_000 * 8)
    assert block_rows_for(10**6) == MIN_BLOCK_ROWS
    assert block_rows_for(16, limit=40) == 40  # a short table (capacity below BLOCK_ROWS) keeps its limit


def test_a_table_that_grows_wide_seals_early_and_reads_back_bit_for_bit(tmp_path):
    """Series added while rows are written: the hot block shrinks (sealing what it held) as the table widens
    past what HOT_BLOCK_BYTES allows at 256 rows; every value reads back exactly, also after a checkpoint."""
    s = Store(retention_seconds=10_000)
    rng = np.random.default_rng(5)
    written: dict[tuple, list[tuple[float, float]]] = {}
    width = 0
    for r in range(300):
        width = min(3000, width + 40)  # 16 -> 32 -> ... -> 4096 columns: the block shrinks to 64 rows on the way
        t = 1000.0 + r
        samples = []
        for c in range(width):
            if c % 7 == 3 and r % 2:
                continue  # written every other row
            v = float(r * 1000 + c) if c % 2 else float(rng.normal())
            samples.append(Sample("m", {"c": str(c)}, v))
            written.setdefault(("m", (("c", str(c)),)), []).append((t, v))
        s.append("t", t, samples)
    tab = s.tables["t"]
    assert tab.block_rows == block_rows_for(tab.hot_vals.shape[1]) < BLOCK_ROWS
    assert tab.hot_vals.nbytes <= HOT_BLOCK_BYTES
    # sealed in the smaller blocks, each merged into the one before it while they fit in BLOCK_ROWS (the blocks
    # sealed as the hot block shrank have odd sizes, so the first stops short of it), then a new one grows
    sizes = [b.n for b in tab.blocks]
    assert len(sizes) == 2 and BLOCK_ROWS - tab.block_rows < sizes[0] <= BLOCK_ROWS and sizes[1] < BLOCK_ROWS, sizes
    assert sum(sizes) + tab.hot_n == 300
    expect = {k: (np.array([p[0] for p in v]), np.array([p[1] for p in v])) for k, v in written.items()}
    _same(_all_series(s), expect)
    checkpoint.save(s, tmp_path)
    back = Store(retention_seconds=10_000)
    assert checkpoint.restore(back, tmp_path).restored
    _same(_all_series(back), expect)


def _rows(seed: int, n_rows: int):
    """Rows of a changing set of containers: (keys list, values) per row; the keys list object is kept while
    the set stays, key tuples are shared between lists, NaN where a value was not read."""
    rng = np.random.default_rng(seed)
    keys_of: dict[int, list] = {}
    live = list(range(30))
    keys: list = []
    out = []
    for r in range(n_rows):
        changed = False
        if r % 9 == 4:  # a container goes, another comes
            live.remove(live[int(rng.integers(len(live)))])
            live.append(100 + r)
            changed = True
        if changed or not keys:
            for c in live:
                if c not in keys_of:
                    lab = {"container_id": f"{c:08x}", "namespace": "default"}
                    keys_of[c] = [("a", lab), ("b", lab), ("c", {**lab, "kind": "some"})]
            keys = [k for c in live for k in keys_of[c]]
        vals = rng.normal(size=len(keys)) * 1e6
        vals[rng.random(len(keys)) < 0.1] = np.nan  # not read this time
        out.append((keys, vals))
    return out


@pytest.mark.parametrize("retention", [40.0, 3600.0])
def test_columns_write_the_same_store_as_samples(retention):
    """append_columns against append of the same samples, with containers coming and going and (at the short
    retention) columns reclaimed and reused: the same series, the same values, bit for bit."""
    a, b = Store(retention_seconds=retention), Store(retention_seconds=retention)
    for r, (keys, vals) in enumerate(_rows(3, 200)):
        row = Columns(keys, vals)
        a.append_columns("cgroup", 1000.0 + r, row)
        b.append("cgroup", 1000.0 + r, row.samples())
    assert a.series_count == b.series_count
    if retention < 100:
        assert a.tables["cgroup"].generation > 0, "columns were reclaimed on the way"
    _same(_all_series(a), _all_series(b))
    assert a.rows_since({})[0].values.shape == b.rows_since({})[0].values.shape


def test_columns_resolve_series_only_when_the_keys_change():
    s = Store()
    keys = [("m", {"c": str(i)}) for i in range(50)]
    vals = np.arange(50, dtype=float)
    vals[7] = np.nan
    s.append_columns("t", 1.0, Columns(keys, vals))
    assert s.series_count == 49, "a series with no value yet is not made"
    tab = s.tables["t"]
    index = {m: {t: dict(cols) for t, cols in by_table.items()} for m, by_table in s._index.items()}
    s._index.clear()  # a lookup of an already-resolved key would now make a new series
    s.append_columns("t", 2.0, Columns(keys, vals + 1))
    assert s.series_count == 49 and len(tab.keys) == 49
    s._index.update(index)
    vals[7] = 70.0
    s.append_columns("t", 3.0, Columns(keys, vals))  # its first value: resolved now
    assert s.series_count == 50
    ref = next(r for r in s.select("m") if r.label_dict["c"] == "7")
    assert s.raw(ref, 0, 10)[1].tolist() == [70.0]


def test_columns_refused_at_max_series_are_counted_and_retried():
    s = Store(max_series=3)
    keys = [("m", {"c": str(i)}) for i in range(5)]
    s.append_columns("t", 1.0, Columns(keys, np.ones(5)))
    assert s.series_count == 3 and s.dropped_samples == 2
    s.append_columns("t", 2.0, Columns(keys, np.ones(5)))
    assert s.dropped_samples == 4


def test_label_pairs_are_shared_between_series():
    s = Store()
    s.append("t", 1.0, [Sample("m", {"namespace": "default", "c": str(i)}, 1.0) for i in range(3)]
             + [Sample("n", {"namespace": "default", "c": "0"}, 1.0)])
    pairs = [dict((p, p) for p in r.labels)[("namespace", "default")] for refs in s.series_by_metric().values()
             for r in refs]
    assert len(pairs) == 4 and all(p is pairs[0] for p in pairs)


def test_a_label_set_is_one_tuple_shared_by_its_series_and_their_keys():
    """A container's metrics, written by append and by append_columns into two tables, and restored from a
    checkpoint, all hold the store's one tuple for the container's label set."""
    s = Store()
    labels = {"namespace": "default", "pod": "p", "container_id": "c0"}
    s.append("t", 1.0, [Sample("m", dict(labels), 1.0), Sample("n", dict(labels), 2.0)])
    s.append_columns("u", 1.0, Columns([("o", dict(labels)), ("m", {"container_id": "c1"})], np.ones(2)))
    held = [r.labels for refs in s.series_by_metric().values() for r in refs if dict(r.labels) == labels]
    held += [k[1] for tab in s.tables.values() for k in tab.keys if k is not None and dict(k[1]) == labels]
    assert len(held) == 6 and all(lk is held[0] for lk in held)
    other = s._intern(tuple(sorted(labels.items())))
    assert other is held[0]


def test_a_label_set_reads_as_its_dict_and_ends_up_holding_the_stores_tuple():
    """A LabelSet is the mapping it was made from (values as text); written through either write path it holds the
    store's interned tuple, the same one the series of a dict with those labels have, and reads back the same."""
    from cri_resmgr.store import LabelSet

    labels = {"container_id": "c0", "resource": "io", "kind": "some", "n": 3}
    ls = LabelSet(labels)
    assert dict(ls) == {k: str(v) for k, v in labels.items()} and len(ls) == 4 and ls["kind"] == "some"
    assert ls == {k: str(v) for k, v in labels.items()} and ls.get("nope") is None and "n" in ls
    with pytest.raises(KeyError):
        ls["nope"]
    own = ls.pairs
    s = Store()
    s.append("t", 1.0, [Sample("m", {"container_id": "c0", "resource": "io", "kind": "some", "n": "3"}, 1.0)])
    s.append_columns("u", 1.0, Columns([("o", ls)], np.ones(1)))
    held = [r.labels for refs in s.series_by_metric().values() for r in refs]
    assert len(held) == 2 and held[0] is held[1] and ls.pairs is held[0] and own is not held[0]
    other = LabelSet(labels)
    s.append("v", 1.0, [Sample("p", other, 2.0)])
    assert other.pairs is held[0]
    with pytest.raises(ValueError):
        ls.share((("a", "b"),))


def test_the_cgroup_collectors_psi_keys_share_the_stores_label_tuples():
    """What the PSI series' keys cost: after a write, each key's labels hold the store's tuple (no dict per series)."""
    from cri_resmgr.collectors.cgroup import _Tracked
    from cri_resmgr.store import LabelSet

    lab = {"namespace": "ns", "pod": "p", "container": "c", "container_id": "x" * 64, "pod_uid": "u", "qos_class": "q"}
    t = _Tracked(None, lab, tuple(f"/f{i}" for i in range(9)))  # (the pressure files make it 9 paths)
    psi = [(m, labels) for m, labels in t.keys if "pressure" in m]
    assert len(psi) == 6 and all(type(labels) is LabelSet for _, labels in psi)
    s = Store()
    s.append_columns("cgroup", 1.0, Columns(t.keys, np.arange(len(t.keys), dtype=float)))
    refs = {r.labels: r for r in s.select(psi[0][0])}
    assert len(refs) == 6 and all(refs[labels.pairs].labels is labels.pairs for _, labels in psi)
