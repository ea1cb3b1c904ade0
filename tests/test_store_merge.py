"""Sealed blocks of a wide table merged into larger ones, and gaps (NaN rows) coded as a bitmap: both lossless
bit for bit, both smaller, the merge bounded in what it keeps past the retention and in the memory it takes, and
both carried through checkpoints."""

import json

import numpy as np
import pytest

from cri_resmgr.store import Columns, Store, checkpoint, tsdb
from cri_resmgr.store.tsdb import Block, compact_rows_for, merge_blocks


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)


def _matrix(rng, n: int, c: int) -> np.ndarray:
    """Agent-shaped columns: µs counters, byte gauges, noise, constants, present/absent gauges (gaps)."""
    kinds = [
        lambda: np.cumsum(rng.integers(0, 10**6, n)) / 1e6,
        lambda: (1 << 30) - np.cumsum(rng.integers(0, 64, n)) * 4096.0,
        lambda: rng.normal(size=n),
        lambda: np.full(n, 7.0),
        lambda: np.where(rng.random(n) < 0.4, np.nan, 1048576.0),
        lambda: np.where(np.arange(n) % 5 == 0, np.nan, np.cumsum(rng.integers(0, 100, n)).astype(float)),
        lambda: np.full(n, np.nan),
    ]
    return np.stack([kinds[i % len(kinds)]() for i in range(c)], axis=1)


def test_compact_rows_is_a_multiple_of_the_hot_blocks_rows_within_an_eighth_of_the_capacity():
    assert compact_rows_for(1801, 32) == 224  # rdt at 2 s for an hour: 1801 // 8 = 225
    assert compact_rows_for(721, 8) == 88  # cgroup at 5 s, 1,000 containers (hot blocks of 8 rows): 721 // 8 = 90
    assert compact_rows_for(721, 32) == 64
    assert compact_rows_for(100_000, 32) == tsdb.BLOCK_ROWS
    assert compact_rows_for(200, 32) == 32  # too short a table to merge: the hot block's rows
    assert compact_rows_for(3601, 256) == 256  # a narrow table: already BLOCK_ROWS
    assert compact_rows_for(1801, 32, limit=64) == 64
    assert compact_rows_for(1801, 16, limit=250) == 224


def test_merged_blocks_read_back_bit_for_bit_with_columns_added_between_them(monkeypatch):
    """Blocks of 5, 7 and 9 columns (series added between seals) merged a few columns at a time: every value
    comes back exactly, and the columns a block did not have read NaN there as before."""
    monkeypatch.setattr(tsdb, "MERGE_CHUNK_VALUES", 3 * 60)  # 3 columns a slice: the slices' groups are joined
    rng = np.random.default_rng(3)
    V = _matrix(rng, 60, 9)
    blocks = [Block(0, np.arange(20.0), V[:20, :5]), Block(20, np.arange(20.0, 40), V[20:40, :7]),
              Block(40, np.arange(40.0, 60), V[40:, :])]
    expect = V.copy()
    expect[:20, 5:] = np.nan
    expect[20:40, 7:] = np.nan
    m = merge_blocks(blocks, 9)
    assert (m.seq0, m.n, m.ncols) == (0, 60, 9)
    assert np.array_equal(bits(m.columns(np.arange(9))), bits(expect))
    for c in range(9):  # the single-series read
        out = np.empty((1, 60))
        m.decode_into(np.array([c]), out)
        assert np.array_equal(bits(out[0]), bits(expect[:, c])), c
    assert np.array_equal(m.ts, np.arange(60.0))
    arrays, meta = m.to_arrays("x_")  # and the checkpoint form
    back = Block.from_arrays(arrays, "x_", json.loads(json.dumps(meta)))
    assert np.array_equal(bits(back.columns(np.arange(9))), bits(expect))


def test_a_present_or_absent_gauge_costs_its_bitmap_not_two_bytes_a_row():
    """A container's RDT occupancy while RMIDs rotate: its value, or NaN. The gaps go to a bitmap and the
    value is constant in between: nothing per row but the bit. Other NaNs (not np.nan's bits) stay XOR."""
    n = 256
    rng = np.random.default_rng(1)
    gauge = np.where(rng.random(n) < 0.5, np.nan, 1048576.0)
    other_nan = np.where(np.arange(n) % 3 == 0, np.array([0x7FF8000000000001], dtype=np.uint64).view(np.float64)[0],
                         2.0)
    lead = np.r_[np.full(10, np.nan), np.arange(n - 10, dtype=float)]  # gaps before the first value
    V = np.stack([gauge, other_nan, lead], axis=1)
    b = Block(0, np.arange(float(n)), V)
    assert b.gapcols.tolist() == [0, 2]
    assert b.width_of(0) == 0  # constant between the gaps: no bytes a row
    assert b.width_of(2) <= 1  # a counter whose first value holds the leading gaps: steps of 0 and 1
    assert b.gapbits.shape == (2, n // 8)  # a bit a row
    assert b.width_of(1) > 0
    assert np.array_equal(bits(b.columns(np.arange(3))), bits(V))
    for c in range(3):
        out = np.empty((1, n))
        b.decode_into(np.array([c]), out)
        assert np.array_equal(bits(out[0]), bits(V[:, c])), c
    out = np.empty((2, n))  # a subset that holds one gap column of two
    b.decode_into(np.array([1, 2]), out)
    assert np.array_equal(bits(out), bits(V[:, [1, 2]].T))


def test_a_gap_bitmap_that_does_not_fit_its_block_is_refused():
    V = np.stack([np.where(np.arange(40) % 2 == 0, np.nan, 3.0), np.arange(40.0)], axis=1)
    arrays, meta = Block(0, np.arange(40.0), V).to_arrays("x_")
    assert meta["gaps"]
    for name, bad in (("gapcols", np.array([5], dtype=np.int32)), ("gapcols", np.array([0], dtype=np.int64)),
                      ("gapbits", np.zeros((1, 4), dtype=np.uint8)), ("gapcols", np.array([0, 0], dtype=np.int32))):
        with pytest.raises(ValueError, match="gap bitmap"):
            Block.from_arrays({**arrays, f"x_{name}": bad}, "x_", meta)


def _rare_steps(rng, n: int, c: int) -> np.ndarray:
    """Columns that change a few times in a block, as an idle container's counters or one counted only while
    watched: byte counters stepping by ~1e10, µs counters with gaps, gauges that change once, beside noise and a
    steady counter (which stay dense)."""
    def steps(k: int, high: int) -> np.ndarray:
        x = np.zeros(n)
        x[rng.choice(n, k, replace=False)] = rng.integers(1, high, k)
        return x

    kinds = [
        lambda: 1e9 + np.cumsum(steps(3, 10**12)),
        lambda: np.where(np.arange(n) >= n // 2, rng.random(), 0.25),
        lambda: np.where(rng.random(n) < 0.05, np.nan, np.round(100 + np.cumsum(steps(2, 10**6)) / 1e6, 6)),
        lambda: rng.random(n) * 1e6,
        lambda: np.arange(n) * 7.0,
    ]
    return np.stack([kinds[i % len(kinds)]() for i in range(c)], axis=1)


@pytest.mark.parametrize("seed", range(6))
def test_columns_that_step_rarely_cost_a_bitmap_and_their_steps_and_read_back_bit_for_bit(seed, monkeypatch):
    # Gorilla spends a bit on an unchanged value; the byte planes spent the widest step's bytes on every row:
    # an RDT counter of a rotated-out idle container (a step of ~1e10 bytes at each watch, 5 bytes a row) took
    # 6.7 of the 8.7 MiB its table held at 1,000 containers (stop 34)
    rng = np.random.default_rng(seed)
    n, c = int(rng.integers(64, 300)), 25
    V = _rare_steps(rng, n, c)
    ts = np.arange(n, dtype=float)
    b = Block(0, ts, V)
    kinds = np.arange(c) % 5
    assert set(b.sparse.cols.tolist()) >= set(np.flatnonzero(kinds < 3).tolist())  # the rare steppers
    assert not set(b.sparse.cols.tolist()) & set(np.flatnonzero(kinds >= 3).tolist())  # noise, steady: dense
    for col in np.flatnonzero(kinds == 0):
        assert b.width_of(int(col)) <= 1  # a bit a row and 8 bytes a step, against 5 bytes a row
    with monkeypatch.context() as mp:  # the same columns with sparse coding off: the byte planes alone
        mp.setattr(tsdb._Sparse, "cost", staticmethod(lambda n, nnz: np.full(len(nnz), np.iinfo(np.int64).max)))
        dense = Block(0, ts, V)
    assert len(dense.sparse.cols) == 0 and bits(dense.columns(np.arange(c))).tolist() == bits(V).tolist()
    rare = np.flatnonzero(kinds < 3)
    assert sum(b.width_of(int(x)) for x in rare) * 3 <= sum(dense.width_of(int(x)) for x in rare)
    assert b.nbytes() < dense.nbytes()
    assert bits(b.columns(np.arange(c))).tolist() == bits(V).tolist()
    for col in range(c):  # one at a time (the single-series read) and in subsets
        assert bits(b.columns(np.array([col])))[:, 0].tolist() == bits(V[:, col]).tolist()
    sub = np.sort(rng.choice(c, 9, replace=False))
    assert bits(b.columns(sub)).tolist() == bits(V[:, sub]).tolist()
    # merged with its neighbours (columns added between them read NaN before), and through the checkpoint form
    k = n // 3
    m = merge_blocks([Block(0, ts[:k], V[:k, :20]), Block(k, ts[k:], V[k:])], c)
    want = V.copy()
    want[:k, 20:] = np.nan
    assert bits(m.columns(np.arange(c))).tolist() == bits(want).tolist()
    arrays, meta = m.to_arrays("x_")
    assert meta["sparse"]
    back = Block.from_arrays(arrays, "x_", meta)
    assert bits(back.columns(np.arange(c))).tolist() == bits(want).tolist()
    assert back.nbytes() == m.nbytes()


def test_sparse_columns_that_do_not_fit_their_block_are_refused():
    V = _rare_steps(np.random.default_rng(1), 100, 5)
    arrays, meta = Block(0, np.arange(100.0), V).to_arrays("x_")
    assert meta["sparse"]
    good = Block.from_arrays(arrays, "x_", meta)
    assert bits(good.columns(np.arange(5))).tolist() == bits(V).tolist()
    for name, bad in (("spcols", np.array([0, 4], dtype=np.int32)),  # not the sparse columns
                      ("spcols", arrays["x_spcols"].astype(np.int64)),
                      ("spbits", np.zeros_like(arrays["x_spbits"])),  # steps without their bits
                      ("spoff", arrays["x_spoff"][:-1]),
                      ("spcodes", arrays["x_spcodes"][:-1]),
                      ("spmode", np.full_like(arrays["x_spmode"], 5))):
        with pytest.raises(ValueError, match="sparse columns|names a group"):
            Block.from_arrays({**arrays, f"x_{name}": bad}, "x_", meta)


def _wide_store(monkeypatch, retention: float = 600.0) -> Store:
    """A store whose tables of 40 columns already count as wide (hot block of 32 rows)."""
    monkeypatch.setattr(tsdb, "HOT_BLOCK_BYTES", 64 * 8 * 32)  # (40 series: room for 64 columns)
    return Store(retention_seconds=retention)


def _write(s: Store, rows: int, start: int = 0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    V = _matrix(rng, rows, 40)
    V[:, 6::7] = 5.0  # (every series written now and then: none is reclaimed)
    keys = [("m", {"c": str(c)}) for c in range(40)]
    ts = 1000.0 + np.arange(start, start + rows)
    for r in range(rows):
        s.append_columns("t", float(ts[r]), Columns(keys, V[r]), 1.0)
    return ts, V


@pytest.mark.parametrize(("retention", "want"), [(600.0, 64), (900.0, 96)])  # 601 // 8 = 75; 901 // 8 = 112
def test_a_wide_table_merges_its_sealed_blocks_and_keeps_at_most_an_eighth_past_the_retention(
        monkeypatch, retention, want):
    s = _wide_store(monkeypatch, retention)
    ts, V = _write(s, 2000)
    tab = s.tables["t"]
    assert tab.block_rows == 32 and tab.capacity == int(retention) + 1
    target = compact_rows_for(tab.capacity, tab.block_rows, tab.max_block_rows)
    assert target == want
    sizes = [b.n for b in tab.blocks]
    full = [n for n in sizes if n == target]
    tail = sizes[len(full):]  # the newest sealed block, growing by each block sealed after it until it is full
    assert sizes[:len(full)] == full and len(tail) <= 1 and all(n % 32 == 0 and n < target for n in tail), sizes
    held = sum(sizes) + tab.hot_n
    assert tab.capacity <= held < tab.capacity + target  # whole blocks expire: at most one merged block more
    col_of = {k: c for c, k in enumerate(tab.keys)}
    cols = np.array([col_of[("m", (("c", str(c)),))] for c in range(40)])
    got_ts, got = tab.rows(tab.floor, tab.seq, cols)  # the retention's rows, exactly
    assert np.array_equal(got_ts, ts[-tab.capacity:])
    assert np.array_equal(bits(got), bits(V[-tab.capacity:]))
    unmerged = sum(Block(0, ts[i:i + 32], V[i:i + 32]).nbytes() for i in range(2000 - 640, 2000 - 64, 32))
    merged = sum(b.nbytes() for b in tab.blocks if b.seq0 >= 2000 - 640 and b.seq0 + b.n <= 2000 - 64)
    assert merged < 0.9 * unmerged  # (the noisy columns cost the same either way: the saving is per column)


def test_merged_blocks_go_through_incremental_checkpoints(monkeypatch, tmp_path):
    """Blocks merged between checkpoints: the merged one is written, the segments only the merged-away blocks
    were in are removed, and a restore equals the store at every step."""
    s = _wide_store(monkeypatch)
    ck = checkpoint.Checkpointer()
    for k in range(12):
        _write(s, 50, start=50 * k, seed=k)
        ck.save(s, tmp_path)
        back = Store(retention_seconds=600.0)
        assert checkpoint.restore(back, tmp_path).restored
        a, b = s.tables["t"], back.tables["t"]
        ta, va = a.rows(a.floor, a.seq, np.arange(40))
        tb, vb = b.rows(b.floor, b.seq, np.arange(40))
        assert np.array_equal(ta, tb) and np.array_equal(bits(va), bits(vb)), k
    manifest = json.loads(bytes(np.load(tmp_path / checkpoint.FILENAME)["meta"]).decode())["tables"][0]["blocks"]
    assert [bm["n"] for bm in manifest][:-1] == [64] * (len(manifest) - 1)  # only merged blocks but the newest
    # the segments that held only merged-away blocks are gone
    assert {p.name for p in tmp_path.glob(f"{checkpoint.SEGMENT_PREFIX}*")} == {bm["seg"] for bm in manifest}


@pytest.mark.parametrize("older", [3, 4])
def test_a_format_3_or_4_checkpoint_is_still_read(tmp_path, older):
    """Format 3 is format 4 without gap bitmaps, format 4 format 5 without sparse columns: a checkpoint with
    neither, labelled 3 or 4, restores the same."""
    s = Store(retention_seconds=3600.0)
    keys = [("m", {"c": str(c)}) for c in range(3)]
    for r in range(300):
        s.append_columns("t", 1000.0 + r, Columns(keys, np.array([r, 2.0 * r, 7.0])), 1.0)
    checkpoint.save(s, tmp_path)
    z = dict(np.load(tmp_path / checkpoint.FILENAME))
    meta = json.loads(bytes(z["meta"]).decode())
    assert meta["version"] == 5
    assert not any(bm.get("gaps") or bm.get("sparse") for t in meta["tables"] for bm in t["blocks"])
    meta["version"] = older
    z["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(tmp_path / checkpoint.FILENAME, **z)
    back = Store(retention_seconds=3600.0)
    assert checkpoint.restore(back, tmp_path).restored
    a, b = s.tables["t"], back.tables["t"]
    assert np.array_equal(bits(a.rows(0, a.seq, np.arange(3))[1]), bits(b.rows(0, b.seq, np.arange(3))[1]))


def test_a_format_3_block_with_a_base_per_column_is_read():
    """Format 3 kept a step for every column and wider group/position arrays; a block in that form reads back the
    same values (and is kept in the narrow form)."""
    from cri_resmgr.store.tsdb import _XOR

    rng = np.random.default_rng(8)
    V = _matrix(rng, 50, 14)
    b = Block(0, np.arange(50.0), V)
    arrays, meta = b.to_arrays("x_")
    assert meta.pop("base") == "groups" and b.gid.dtype == np.int8 and b.pos.dtype == np.uint16
    full = np.zeros(b.ncols, dtype=np.int64)
    for c in range(b.ncols):
        g = int(b.gid[c])
        if g >= 0 and b.groups[g][3] != _XOR:
            full[c] = b.base[b.boff[g] + int(b.pos[c])]
    assert full.any()  # (some columns are delta-coded with a step)
    old = {**arrays, "x_base": full, "x_gid": b.gid.astype(np.int16), "x_pos": b.pos.astype(np.int32)}
    back = Block.from_arrays(old, "x_", json.loads(json.dumps(meta)))
    assert np.array_equal(bits(back.columns(np.arange(14))), bits(V))
    assert back.base.tolist() == b.base.tolist() and back.gid.dtype == np.int8


@pytest.mark.parametrize("fmt", [3, 5])
def test_a_block_whose_columns_are_placed_out_of_order_in_their_groups_reads_back_the_same(fmt):
    """A block keeps no place per column: a column's place in its group is its rank among the group's columns. A
    checkpoint may name any order (``pos``: the encoders write column order); such a block is laid out again in
    column order when read, payloads and steps alike, in format 5 (steps per group) and 3 (a step per column)."""
    from cri_resmgr.store.tsdb import _XOR

    rng = np.random.default_rng(9)
    V = _matrix(rng, 40, 60)
    b = Block(0, np.arange(40.0), V)
    assert "pos" not in Block.__slots__
    arrays, meta = b.to_arrays("x_")
    pos = b.pos.astype(np.int64)
    base = b.base.copy()
    full = np.zeros(b.ncols, dtype=np.int64)
    flipped = 0
    for g, (_, _, planes, mode) in enumerate(b.groups):
        cols = np.flatnonzero(b.gid == g)
        if len(cols) < 2:
            continue
        new = rng.permutation(len(cols))  # column cols[j] now at place new[j]
        flipped += 1
        payload = np.empty_like(planes)
        payload[new] = planes
        arrays[f"x_g{g}"] = payload
        if mode != _XOR:
            seg = b.base[b.boff[g] + np.arange(len(cols))]
            base[b.boff[g] + new] = seg
            full[cols] = seg
        pos[cols] = new
    assert flipped >= 2 and any(m != _XOR for _, _, _, m in b.groups)
    arrays["x_pos"] = pos.astype(np.uint16)
    if fmt == 5:
        arrays["x_base"] = base
    else:
        meta.pop("base")
        arrays["x_base"] = full
    back = Block.from_arrays(arrays, "x_", json.loads(json.dumps(meta)))
    assert np.array_equal(bits(back.columns(np.arange(60))), bits(V))
    for c in (0, 17, 59):  # one column alone (its own path)
        assert np.array_equal(bits(back.columns(np.array([c]))[:, 0]), bits(V[:, c]))
    again, _ = back.to_arrays("y_")
    assert np.array_equal(again["y_pos"], b.pos) and np.array_equal(again["y_base"], b.base)


def test_the_store_merges_sealed_blocks_outside_its_lock(monkeypatch):
    """A merge at 1,000 containers takes tens of ms: a scrape or another collector's write must not wait for it.
    While the store merges, another thread takes the store's lock at once; the merged block then replaces the small
    ones, and a merge whose blocks went meanwhile changes nothing."""
    import threading

    s = _wide_store(monkeypatch)
    seen: list[bool] = []
    real = tsdb.merge_blocks

    def merge_watching_the_lock(blocks, ncols):
        got: list[bool] = []

        def take() -> None:
            got.append(s.lock.acquire(timeout=2))
            if got[0]:
                s.lock.release()

        th = threading.Thread(target=take)
        th.start()
        th.join()
        seen.append(got[0])
        return real(blocks, ncols)

    monkeypatch.setattr(tsdb, "merge_blocks", merge_watching_the_lock)
    _write(s, 200)
    tab = s.tables["t"]
    assert seen and all(seen), "the lock was held during a merge"
    assert [b.n for b in tab.blocks][:3] == [64, 64, 64]
    tail = list(tab.blocks)[:2]
    assert not tab.replace_merged([tail[1], tail[0]], real(tail, 40))  # not consecutive in that order
    assert [b.n for b in tab.blocks][:3] == [64, 64, 64]


def test_the_store_calls_after_merge_once_per_merge_outside_its_lock(monkeypatch, tmp_path):
    """The agent returns what a merge freed to the OS right after it (Store.after_merge = heap.release_free_heap):
    the hook runs once per merge, after the merged block is in place, without the store's lock held."""
    import threading

    from cri_resmgr.agent import Agent
    from cri_resmgr.config import build_config
    from cri_resmgr.heap import release_free_heap

    s = _wide_store(monkeypatch)
    merges: list[int] = []
    real = tsdb.merge_blocks
    monkeypatch.setattr(tsdb, "merge_blocks", lambda blocks, ncols: merges.append(len(blocks)) or real(blocks, ncols))
    calls: list[tuple[int, bool]] = []

    def hook():
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(s.lock.acquire(timeout=1) and (s.lock.release() or True)))
        t.start()
        t.join()
        calls.append((len(merges), got == [True]))

    s.after_merge = hook
    _write(s, 400)
    assert merges and calls == [(i + 1, True) for i in range(len(merges))]
    assert all(b.n % 32 == 0 for b in s.tables["t"].blocks)
    cfg = build_config({"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run")}, env={})
    assert Agent(cfg).store.after_merge is release_free_heap  # (the agent's store trims after its merges)


def test_blocks_keep_first_values_and_groups_packed_and_only_the_last_read_unpacked(monkeypatch):
    """A block's first values and groups are kept zlib-packed (many columns start at the same value) and unpacked
    when read; the unpacked arrays are kept for the last blocks read only, up to a byte budget, and values read
    back bit for bit whichever blocks were let go meanwhile."""
    monkeypatch.setattr(tsdb._UNPACKED, "limit", 3 * 1000 * 9)  # three blocks' unpacked arrays
    rng = np.random.default_rng(11)
    vals = np.zeros((16, 1000))
    vals[:, ::7] = rng.normal(size=(16, len(range(0, 1000, 7))))
    blocks = [Block(16 * i, np.arange(16.0) + 16 * i, vals + i) for i in range(8)]
    for b in blocks:
        assert b._first is None and len(b._zfirst) + len(b._zgid) < (b.first.nbytes + b.gid.nbytes) / 4
    for _ in range(2):
        for i, b in enumerate(blocks):
            assert np.array_equal(b.columns(np.arange(1000)).view(np.uint64), (vals + i).view(np.uint64))
            assert sum(x._first is not None for x in blocks) <= 4
    with pytest.raises(ValueError):
        blocks[0].first[0] = 1  # read-only: a reader cannot change what other readers unpack
