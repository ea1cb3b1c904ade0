"""Checkpoint the store to ``state_dir`` and restore it at start.

Format: one ``.npz`` (a zip of ``.npy`` arrays, each member CRC-checked by zipfile) holding, per table,
its sealed blocks as they are in memory (compressed, see ``tsdb.Block``), its uncompressed newest rows,
per-column state, and the series keys (as JSON). Writes go to a temporary file in the
same directory, are fsync'ed, then renamed over the old checkpoint, so a crash leaves either the old or
the new file, never a torn one. A checkpoint that cannot be read is reported and moved aside.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .tsdb import Block, Store

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 1: plain float64 rings (still read)
FILENAME = "store.npz"


@dataclass
class RestoreResult:
    restored: bool
    series: int = 0
    error: str | None = None
    future_rows: int = 0  # rows dropped because their time was after the clock at restore
    note: str | None = None  # what was dropped, for the log and /api/v1/store


def save(store: Store, state_dir: Path) -> Path:
    state_dir = Path(state_dir)
    path = state_dir / FILENAME
    tmp = state_dir / f".{FILENAME}.{os.getpid()}.tmp"
    arrays: dict[str, np.ndarray] = {}
    tables: list[dict] = []
    meta = {"version": FORMAT_VERSION, "saved_at": time.time(), "tables": tables}
    with store.lock:
        for i, tab in enumerate(store.tables.values()):
            # Sealed blocks go as they are (compressed); the hot rows as a plain matrix. Nothing is decoded.
            blocks = []
            for j, b in enumerate(tab.blocks):  # (expired blocks are dropped as rows are written)
                arr, bm = b.to_arrays(f"t{i}_b{j}_")
                arrays.update(arr)
                blocks.append(bm)
            ncols = len(tab.keys)
            arrays[f"t{i}_hot_ts"] = tab.hot_ts[: tab.hot_n].copy()
            arrays[f"t{i}_hot_vals"] = tab.hot_vals[: tab.hot_n, :ncols].copy()
            for name in ("last_seq", "last_val", "last_t", "since"):
                arrays[f"t{i}_{name}"] = getattr(tab, name)[:ncols].copy()
            tables.append(
                {
                    "name": tab.name,
                    "capacity": tab.capacity,
                    "seq": tab.seq,
                    "keys": [None if k is None else [k[0], [list(kv) for kv in k[1]]] for k in tab.keys],
                    "blocks": blocks,
                }
            )
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, allow_pickle=False, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(state_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def restore(store: Store, state_dir: Path, interval_of=lambda table: 1.0, now: float | None = None,
            future_tolerance_seconds: float = 5.0) -> RestoreResult:
    """Load a checkpoint into an empty store. Never raises on a bad file, whatever is wrong with it (torn,
    flipped bytes, wrong types or shapes, a file that is not a checkpoint): reports it and moves it aside, so
    the agent starts. Rows from after ``now`` (+ tolerance: the wall clock was set back since the checkpoint
    was written) are dropped and reported: appending after them would be refused as out of order."""
    path = Path(state_dir) / FILENAME
    try:
        if not path.exists():
            return RestoreResult(False)
        n = _load(store, path, interval_of)
        res = RestoreResult(True, series=n)
        if now is not None:
            res.future_rows, ahead = _drop_future(store, now + future_tolerance_seconds)
            if res.future_rows:
                res.note = (f"checkpoint {path}: dropped {res.future_rows} rows from the future (up to {ahead:.0f} s "
                            f"after the clock at restore; the wall clock was set back)")
                log.warning(res.note)
        return res
    except Exception as e:  # any failure to read is the file's fault: it must not stop the agent (crash loop)
        aside = path.with_name(f"{FILENAME}.corrupt-{time.time_ns()}")
        msg = f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); moved to {aside.name}, starting empty"
        log.warning(msg, exc_info=True)
        try:
            os.replace(path, aside)
        except OSError as e2:
            msg += f" (could not move it aside: {e2.strerror}; it will be overwritten by the next checkpoint)"
        store.clear()  # undo a partial load
        return RestoreResult(False, error=msg)


def _drop_future(store: Store, limit: float) -> tuple[int, float]:
    """Rebuild every table whose rows reach past ``limit`` from its rows up to ``limit`` (times are in order,
    so they are a prefix). Returns (rows dropped, how far past ``limit`` the newest was)."""
    dropped, ahead = 0, 0.0
    with store.lock:
        for name, tab in list(store.tables.items()):
            last = tab.last_time()
            if last is None or last <= limit:
                continue
            ahead = max(ahead, last - limit)
            lo = max(tab.floor, tab.blocks[0].seq0 if tab.blocks else tab.floor)
            ncols = len(tab.keys)
            ts, V = tab.rows(lo, tab.seq, np.arange(ncols))
            keep = int(np.searchsorted(ts, limit, side="right"))
            dropped += len(ts) - keep
            new = store.replace_table(name, tab.capacity, columns=max(16, ncols))
            new.keys, new.col_of, new.free = tab.keys, tab.col_of, tab.free
            for r in range(keep):  # renumbered from 0: only what was written, so last_* come out right
                cols = np.flatnonzero(~np.isnan(V[r]))
                new.write_row(float(ts[r]), cols, V[r, cols])
    return dropped, ahead


def _load(store: Store, path: Path, interval_of) -> int:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if not isinstance(meta, dict) or not isinstance(meta.get("tables"), list):
            raise ValueError(f"meta is a {type(meta).__name__} without a list of tables, not a checkpoint's")
        version = meta.get("version")
        if version not in (1, FORMAT_VERSION):
            raise ValueError(f"unsupported checkpoint version {version!r}")
        loaded = {name: z[name] for name in z.files}
    total = 0
    with store.lock:
        for i, tm in enumerate(meta["tables"]):
            # Size from the current retention, which may differ from when it was saved.
            cap = store.table(tm["name"], interval_of(tm["name"])).capacity
            load = _load_table_v1 if version == 1 else _load_table
            total += load(store, tm, i, loaded, cap)
    return total


def _key(k) -> tuple:
    return (str(k[0]), tuple((str(a), str(b)) for a, b in k[1]))


def _load_table(store: Store, tm: dict, i: int, loaded: dict, cap: int) -> int:
    keys = [None if k is None else _key(k) for k in tm["keys"]]
    ncols = len(keys)
    seq = int(tm["seq"])
    tab = store.replace_table(tm["name"], cap, columns=max(16, ncols))
    hot_ts, hot_vals = loaded[f"t{i}_hot_ts"], loaded[f"t{i}_hot_vals"]
    if hot_ts.ndim != 1 or hot_vals.shape != (len(hot_ts), ncols):
        raise ValueError(f"table {tm['name']!r}: hot rows of shape {hot_vals.shape}, {ncols} keys")
    for name in ("last_seq", "last_val", "last_t", "since"):
        a = loaded[f"t{i}_{name}"]
        if a.shape != (ncols,):
            raise ValueError(f"table {tm['name']!r}: {name} has shape {a.shape}, {ncols} keys")
    blocks = [Block.from_arrays(loaded, f"t{i}_b{j}_", bm) for j, bm in enumerate(tm["blocks"])]
    expect = seq - len(hot_ts)
    for b in reversed(blocks):  # blocks must tile the rows up to the hot ones, in time order
        if b.seq0 + b.n != expect or b.ncols > ncols:
            raise ValueError(f"table {tm['name']!r}: blocks do not line up (block at seq {b.seq0})")
        expect = b.seq0
    times = [b.t_last for b in blocks] + ([float(hot_ts[0])] if len(hot_ts) else [])
    if any(b < a for a, b in itertools.pairwise(times)) or (len(hot_ts) > 1 and np.any(np.diff(hot_ts) < 0)):
        raise ValueError(f"table {tm['name']!r}: timestamps out of order")
    tab.keys = list(keys)
    tab.seq = seq
    tab.first_seq = blocks[0].seq0 if blocks else seq - len(hot_ts)  # the rows before were not saved
    tab.blocks.extend(blocks)
    if len(hot_ts):  # sealed on load: the hot block starts empty, whatever block size this table now has
        tab.blocks.append(Block(seq - len(hot_ts), hot_ts, hot_vals))
    for name in ("last_seq", "last_val", "last_t", "since"):
        getattr(tab, name)[:ncols] = loaded[f"t{i}_{name}"]
    n = 0
    for col, key in enumerate(keys):
        if key is None or not store.adopt_series(tab, key, col):
            tab.keys[col] = None
            tab.free.append(col)
            continue
        tab.col_of[key] = col
        n += 1
    tab.drop_expired()  # the retention may be shorter now than when the checkpoint was saved
    return n


def _load_table_v1(store: Store, tm: dict, i: int, loaded: dict, cap: int) -> int:
    """Format 1 (a plain ring of float64 rows): rewritten row by row into the current table layout."""
    ts = loaded[f"t{i}_ts"]
    vals = loaded[f"t{i}_vals"]
    keys = [_key(k) for k in tm["keys"]]
    if vals.shape != (len(ts), len(keys)) or ts.ndim != 1:
        raise ValueError(f"table {tm['name']!r}: shape {vals.shape} does not match {len(ts)} rows")
    if len(ts) > 1 and np.any(np.diff(ts) < 0):
        raise ValueError(f"table {tm['name']!r}: timestamps out of order")
    tab = store.replace_table(tm["name"], cap, columns=max(16, len(keys)))
    keep = slice(max(0, len(ts) - cap), len(ts))
    ts, vals = ts[keep], vals[keep]
    cols = []
    for key in keys:
        col, _ = tab.column(key)
        if not store.adopt_series(tab, key, col):
            break
        cols.append(col)
    c = np.asarray(cols, dtype=np.int64)
    for r in range(len(ts)):
        tab.write_row(float(ts[r]), c, vals[r, : len(cols)])
    n = len(ts)
    ages = tm.get("last_age", [0] * len(keys))
    for j, (col, age) in enumerate(zip(cols, ages, strict=False)):  # cols stop early at max_series
        row = n - 1 - int(age)
        tab.last_seq[col] = row
        tab.last_val[col] = vals[row, j] if 0 <= row < n else np.nan
        tab.last_t[col] = ts[row] if 0 <= row < n else np.nan
    return len(cols)
