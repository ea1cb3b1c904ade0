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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .tsdb import Block, Labels, Store, Table

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
            sealed, hot_ts, hot_vals, state = tab.saved_state()
            blocks = []
            for j, b in enumerate(sealed):  # (expired blocks are dropped as rows are written)
                arr, bm = b.to_arrays(f"t{i}_b{j}_")
                arrays.update(arr)
                blocks.append(bm)
            arrays[f"t{i}_hot_ts"] = hot_ts
            arrays[f"t{i}_hot_vals"] = hot_vals
            for name, a in state.items():
                arrays[f"t{i}_{name}"] = a
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
            res.future_rows, ahead = store.drop_after(now + future_tolerance_seconds)
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
            cap = store.capacity_for(interval_of(tm["name"]))
            load = _load_table_v1 if version == 1 else _load_table
            total += load(store, tm, i, loaded, cap)
    return total


def _key(k) -> tuple:
    return (str(k[0]), tuple((str(a), str(b)) for a, b in k[1]))


def _load_table(store: Store, tm: dict, i: int, loaded: dict, cap: int) -> int:
    keys = [None if k is None else _key(k) for k in tm["keys"]]
    blocks = [Block.from_arrays(loaded, f"t{i}_b{j}_", bm) for j, bm in enumerate(tm["blocks"])]
    state = {name: loaded[f"t{i}_{name}"] for name in Table.STATE}
    return store.restore_table(tm["name"], cap, keys, int(tm["seq"]), blocks, loaded[f"t{i}_hot_ts"],
                               loaded[f"t{i}_hot_vals"], state)


def _load_table_v1(store: Store, tm: dict, i: int, loaded: dict, cap: int) -> int:
    """Format 1 (a plain ring of float64 rows): its newest ``cap`` rows restored as one block."""
    ts = loaded[f"t{i}_ts"]
    vals = loaded[f"t{i}_vals"]
    keys: list[tuple[str, Labels] | None] = [_key(k) for k in tm["keys"]]
    if vals.shape != (len(ts), len(keys)) or ts.ndim != 1:
        raise ValueError(f"table {tm['name']!r}: shape {vals.shape} does not match {len(ts)} rows")
    keep = slice(max(0, len(ts) - cap), len(ts))
    ts, vals = np.asarray(ts[keep], dtype=np.float64), np.asarray(vals[keep], dtype=np.float64)
    n = len(ts)
    ages = np.asarray(tm.get("last_age", [0] * len(keys)), dtype=np.int64)
    if ages.shape != (len(keys),):
        raise ValueError(f"table {tm['name']!r}: {ages.shape} last ages for {len(keys)} keys")
    last = n - 1 - ages  # the row of each series' last write
    held = (last >= 0) & (last < n)
    at = np.clip(last, 0, max(n - 1, 0))
    state = {"last_seq": last, "since": np.zeros(len(keys), dtype=np.int64),
             "last_val": np.where(held, vals[at, np.arange(len(keys))] if n else np.nan, np.nan),
             "last_t": np.where(held, ts[at] if n else np.nan, np.nan)}
    return store.restore_table(tm["name"], cap, keys, n, [], ts, vals, state)
