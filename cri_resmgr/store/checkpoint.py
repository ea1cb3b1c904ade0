"""Checkpoint the store to ``state_dir`` and restore it at start.

Format: one ``.npz`` (a zip of ``.npy`` arrays, each member CRC-checked by zipfile) holding, per table,
its timestamps, values, ring position and series keys (as JSON). Writes go to a temporary file in the
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

from .tsdb import SeriesRef, Store, Table

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
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
            rows = tab.order()
            used = [c for c, k in enumerate(tab.keys) if k is not None]
            arrays[f"t{i}_ts"] = tab.ts[rows].copy()
            arrays[f"t{i}_vals"] = tab.vals[np.ix_(rows, used)].copy() if used else np.zeros((len(rows), 0))
            meta["tables"].append(
                {
                    "name": tab.name,
                    "capacity": tab.capacity,
                    "keys": [[tab.keys[c][0], [list(kv) for kv in tab.keys[c][1]]] for c in used],
                    "last_age": [int(tab.seq - 1 - tab.last_seq[c]) for c in used],
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
        store._series = 0
        return RestoreResult(False, error=msg)


def _load(store: Store, path: Path, interval_of) -> int:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"unsupported checkpoint version {meta.get('version')!r}")
        loaded = {name: z[name] for name in z.files}
    total = 0
    with store.lock:
        for i, tm in enumerate(meta["tables"]):
            ts = loaded[f"t{i}_ts"]
            vals = loaded[f"t{i}_vals"]
            keys = [(k[0], tuple((str(a), str(b)) for a, b in k[1])) for k in tm["keys"]]
            if vals.shape != (len(ts), len(keys)) or ts.ndim != 1:
                raise ValueError(f"table {tm['name']!r}: shape {vals.shape} does not match {len(ts)} rows")
            if len(ts) > 1 and np.any(np.diff(ts) < 0):
                raise ValueError(f"table {tm['name']!r}: timestamps out of order")
            # Size from the current retention, which may differ from when it was saved.
            cap = store.table(tm["name"], interval_of(tm["name"])).capacity
            tab = store.tables[tm["name"]] = Table(tm["name"], cap, columns=max(16, len(keys)))
            keep = slice(max(0, len(ts) - cap), len(ts))
            ts, vals = ts[keep], vals[keep]
            n = len(ts)
            cols = []
            for key in keys:
                if store.series_count >= store.max_series:
                    break
                col, _ = tab.column(key)
                store.index.setdefault(key[0], {})[key[1]] = SeriesRef(key[0], key[1], tab.name, col)
                store._series += 1
                cols.append(col)
            tab.ts[:n] = ts
            if cols:
                tab.vals[:n, cols] = vals[:, : len(cols)]
            tab.count = n
            tab.head = n % cap
            tab.seq = n
            ages = tm.get("last_age", [0] * len(keys))
            for col, age in zip(cols, ages):
                tab.last_seq[col] = n - 1 - int(age)
            total += len(cols)
    return total
