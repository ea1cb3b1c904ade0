"""Checkpoint the store to ``state_dir`` and restore it at start.

Format: one ``.npz`` (a zip of ``.npy`` arrays, each member CRC-checked by zipfile) holding, per table,
its sealed blocks as they are in memory (compressed, see ``tsdb.Block``), its uncompressed newest rows,
per-column state, and the series keys (as JSON). Writes go to a temporary file in the
same directory, are fsync'ed, then renamed over the old checkpoint, so a crash leaves either the old or
the new file, never a torn one. A checkpoint that cannot be read is reported and moved aside.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .tsdb import Block, SeriesRef, Store, Table

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 1: plain float64 rings (still read)
FILENAME = "store.npz"


@dataclass
class RestoreResult:
    restored: bool
    series: int = 0
    error: str | None = None


def save(store: Store, state_dir: Path) -> Path:
    state_dir = Path(state_dir)
    path = state_dir / FILENAME
    tmp = state_dir / f".{FILENAME}.{os.getpid()}.tmp"
    arrays: dict[str, np.ndarray] = {}
    meta = {"version": FORMAT_VERSION, "saved_at": time.time(), "tables": []}
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
            meta["tables"].append(
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
            np.savez(f, **arrays)
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


def restore(store: Store, state_dir: Path, interval_of=lambda table: 1.0) -> RestoreResult:
    """Load a checkpoint into an empty store. Never raises on bad files: reports and moves them aside."""
    path = Path(state_dir) / FILENAME
    if not path.exists():
        return RestoreResult(False)
    try:
        n = _load(store, path, interval_of)
        return RestoreResult(True, series=n)
    except (OSError, ValueError, KeyError, TypeError, IndexError, zipfile.BadZipFile, EOFError) as e:
        aside = path.with_name(f"{FILENAME}.corrupt-{int(time.time())}")
        msg = f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); moved to {aside.name}, starting empty"
        log.warning(msg)
        try:
            os.replace(path, aside)
        except OSError:
            pass
        # Undo a partial load.
        store.tables.clear()
        store.index.clear()
        store._inverted.clear()
        store._series = 0
        return RestoreResult(False, error=msg)


def _load(store: Store, path: Path, interval_of) -> int:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
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


def _register(store: Store, tab: Table, key, col: int) -> bool:
    if store.series_count >= store.max_series:
        return False
    store.index.setdefault(key[0], {})[key[1]] = SeriesRef(key[0], key[1], tab.name, col)
    store._inverted.pop(key[0], None)
    store._series += 1
    return True


def _load_table(store: Store, tm: dict, i: int, loaded: dict, cap: int) -> int:
    keys = [None if k is None else _key(k) for k in tm["keys"]]
    ncols = len(keys)
    seq = int(tm["seq"])
    tab = store.tables[tm["name"]] = Table(tm["name"], cap, columns=max(16, ncols))
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
    if any(b < a for a, b in zip(times, times[1:])) or (len(hot_ts) > 1 and np.any(np.diff(hot_ts) < 0)):
        raise ValueError(f"table {tm['name']!r}: timestamps out of order")
    tab.keys = list(keys)
    tab.seq = seq
    tab.blocks.extend(blocks)
    if len(hot_ts):  # sealed on load: the hot block starts empty, whatever block size this table now has
        tab.blocks.append(Block(seq - len(hot_ts), hot_ts, hot_vals))
    for name in ("last_seq", "last_val", "last_t", "since"):
        getattr(tab, name)[:ncols] = loaded[f"t{i}_{name}"]
    n = 0
    for col, key in enumerate(keys):
        if key is None or not _register(store, tab, key, col):
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
    tab = store.tables[tm["name"]] = Table(tm["name"], cap, columns=max(16, len(keys)))
    keep = slice(max(0, len(ts) - cap), len(ts))
    ts, vals = ts[keep], vals[keep]
    cols = []
    for key in keys:
        col, _ = tab.column(key)
        if not _register(store, tab, key, col):
            break
        cols.append(col)
    c = np.asarray(cols, dtype=np.int64)
    for r in range(len(ts)):
        tab.write_row(float(ts[r]), c, vals[r, : len(cols)])
    n = len(ts)
    ages = tm.get("last_age", [0] * len(keys))
    for j, (col, age) in enumerate(zip(cols, ages)):
        row = n - 1 - int(age)
        tab.last_seq[col] = row
        tab.last_val[col] = vals[row, j] if 0 <= row < n else np.nan
        tab.last_t[col] = ts[row] if 0 <= row < n else np.nan
    return len(cols)
