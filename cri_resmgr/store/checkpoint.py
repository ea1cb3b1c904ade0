"""Checkpoint the store to ``state_dir`` and restore it at start.

Format 4: a manifest, ``store.npz`` (a zip of ``.npy`` arrays, each member CRC-checked by zipfile), holding per
table its uncompressed newest rows, per-column state, its series keys (JSON bytes) and the list of its sealed
blocks (compressed, see ``tsdb.Block``), each stored either in the manifest itself or in a *segment*
``store.seg-<id>.npz`` written by an earlier checkpoint. A sealed block never changes, so a :class:`Checkpointer`
that keeps running writes each block once, into the segment of the first checkpoint after it was sealed: a
checkpoint costs what was sealed since the last one plus the hot tail, not the whole retention. Keys are encoded
again only when a table's series changed. :func:`save` writes every block into the manifest; a new
:class:`Checkpointer`'s first checkpoint writes every block into its segment.

Every file goes to a temporary name in the same directory, is fsync'ed, then renamed; segments before the manifest
that names them, and segments no manifest names any more are removed only after the new manifest is in place. A
crash therefore leaves the old manifest with every segment it names, or the new one with every segment it names.
A checkpoint that cannot be read (the manifest or a segment it names) is reported and the manifest moved aside.
Formats 1 (plain float64 rings), 2 (format 3 without segments, keys in the meta JSON), 3 (format 4 without the
blocks' gap bitmaps) and 4 (format 5 without their sparse columns) are still read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .tsdb import Block, Labels, Store, Table

log = logging.getLogger(__name__)

# 1: plain float64 rings; 2: one file, keys in the meta JSON; 3: format 4 without gap bitmaps in blocks; 4: format 5
# without sparse columns in blocks (all still read). An agent that reads format 3 only refuses format 4 rather than
# read its gaps as values, and one that reads up to 4 refuses format 5 by its version (tsdb._Sparse).
FORMAT_VERSION = 5
FILENAME = "store.npz"
SEGMENT_PREFIX = "store.seg-"  # + id + ".npz"


@dataclass
class RestoreResult:
    restored: bool
    series: int = 0
    error: str | None = None
    future_rows: int = 0  # rows dropped because their time was after the clock at restore
    note: str | None = None  # what was dropped, for the log and /api/v1/store


@dataclass
class SaveStats:
    """What the last :meth:`Checkpointer.save` wrote."""

    blocks_written: int = 0
    blocks_kept: int = 0  # sealed blocks left in segments written before
    bytes_written: int = 0
    keys_encoded: int = 0  # tables whose keys were encoded again


def _fsync_dir(d: Path) -> None:
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> int:
    """``arrays`` to ``path`` whole or not at all (temporary file, fsync, rename); returns the bytes written.
    The directory is not fsync'ed here: the caller does once."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, allow_pickle=False, **arrays)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return size


def encode_keys(keys: list[tuple[str, Labels] | None]) -> bytes:
    """A table's series keys as JSON, each metric name and label pair written once and the keys as indices
    (``{"metrics": [...], "pairs": [[name, value], ...], "keys": [[metric, pair, ...] or null, ...]}``): a
    tenth of the keys written out, as the same pod's labels recur in every one of its series."""
    metric_ix: dict[str, int] = {}
    pair_ix: dict[tuple[str, str], int] = {}
    out: list[list[int] | None] = []
    for k in keys:
        if k is None:
            out.append(None)
            continue
        out.append([metric_ix.setdefault(k[0], len(metric_ix)), *[pair_ix.setdefault(p, len(pair_ix)) for p in k[1]]])
    return json.dumps({"metrics": list(metric_ix), "pairs": list(pair_ix), "keys": out}, separators=(",", ":")).encode()


def decode_keys(data: bytes) -> list[tuple[str, Labels] | None]:
    """Inverse of :func:`encode_keys`; raises ValueError (or TypeError) on anything else."""
    doc = json.loads(data.decode())
    if not isinstance(doc, dict):
        raise ValueError(f"keys are a {type(doc).__name__}, not an object")
    metrics, pairs, keys = doc["metrics"], doc["pairs"], doc["keys"]
    if not (isinstance(metrics, list) and isinstance(pairs, list) and isinstance(keys, list)):
        raise ValueError("keys: metrics, pairs and keys must be lists")
    names = [str(m) if isinstance(m, str) else _bad(f"metric name {m!r}") for m in metrics]
    labels = [(str(p[0]), str(p[1])) if isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
              else _bad(f"label pair {p!r}") for p in pairs]
    out: list[tuple[str, Labels] | None] = []
    for k in keys:
        if k is None:
            out.append(None)
            continue
        if not (isinstance(k, list) and k and all(type(i) is int for i in k)
                and 0 <= k[0] < len(names) and all(0 <= i < len(labels) for i in k[1:])):
            raise ValueError(f"keys: {str(k)[:40]} is not a key")
        out.append((names[k[0]], tuple(labels[i] for i in k[1:])))
    return out


def _bad(what: str):
    raise ValueError(f"keys: {what[:60]} is not one")


class Checkpointer:
    """Writes checkpoints of one store into one directory, remembering which sealed blocks are already on disk
    (and where) and each table's encoded keys, so that the next checkpoint writes only what changed. One per
    agent; :meth:`restore` through it lets the checkpoints after a start keep the restored segments.
    ``segments=False`` writes every block into the manifest each time (one file, as :func:`save` does)."""

    def __init__(self, segments: bool = True) -> None:
        self.segments = segments
        self._lock = threading.Lock()
        # block (hashed by identity) -> (segment file name, array prefix) of the blocks that live in a segment
        self._on_disk: dict[Block, tuple[str, str]] = {}
        # table name -> (table, keys_version, encoded keys deflated): what the next checkpoint writes of a table
        # whose keys did not change. Deflated, as the keys of a pod's series repeat its labels: at 1,000
        # containers the cgroup table's 0.9 MB of JSON take ~0.1 MB, and inflating them again ~1 ms a checkpoint
        # (encoding them anew: ~15 ms)
        self._keys: dict[str, tuple[Table, int, bytes]] = {}
        self.last = SaveStats()

    def save(self, store: Store, state_dir: Path) -> Path:
        with self._lock:
            return self._save(store, Path(state_dir))

    def _keys_of(self, tab: Table, version: int, keys: list | None) -> np.ndarray:
        """The encoded keys of a table; ``keys`` is None when ``version`` is the one cached."""
        if keys is None:  # (decided under the store's lock with the cache entry in hand)
            return np.frombuffer(zlib.decompress(self._keys[tab.name][2]), dtype=np.uint8)
        data = encode_keys(keys)
        self._keys[tab.name] = (tab, version, zlib.compress(data, 1))
        self.last.keys_encoded += 1
        return np.frombuffer(data, dtype=np.uint8)

    def _save(self, store: Store, state_dir: Path) -> Path:
        self.last = stats = SaveStats()
        path = state_dir / FILENAME
        arrays: dict[str, np.ndarray] = {}  # the manifest
        segment: dict[str, np.ndarray] = {}  # the blocks sealed since the last checkpoint
        seg_name = f"{SEGMENT_PREFIX}{time.time_ns():x}.npz" if self.segments else ""
        tables: list[dict] = []
        placed: dict[Block, tuple[str, str]] = {}
        # A segment removed behind our back (another writer's full checkpoint, an operator): its blocks again.
        gone = {seg for seg in {v[0] for v in self._on_disk.values()} if not (state_dir / seg).exists()}
        if gone:
            self._on_disk = {k: v for k, v in self._on_disk.items() if v[0] not in gone}
        snap = []
        with store.lock:  # copies of the hot rows and state; blocks are immutable
            for tab in store.tables.values():
                sealed, hot_ts, hot_vals, state = tab.saved_state()
                cached = self._keys.get(tab.name)
                same = cached is not None and cached[0] is tab and cached[1] == tab.keys_version
                snap.append((tab, tab.capacity, tab.seq, tab.keys_version, None if same else list(tab.keys),
                             sealed, hot_ts, hot_vals, state))
        for i, (tab, capacity, seq, version, keys, sealed, hot_ts, hot_vals, state) in enumerate(snap):
            blocks = []
            for j, b in enumerate(sealed):  # (expired blocks are dropped as rows are written)
                where = self._on_disk.get(b)
                if where is not None:
                    seg, prefix = where
                    bm = b.to_arrays(prefix)[1]  # (arrays are views: only the small meta is built)
                    stats.blocks_kept += 1
                else:
                    seg, prefix = seg_name, f"t{i}_b{j}_"
                    arr, bm = b.to_arrays(prefix)
                    (segment if seg else arrays).update(arr)
                    stats.blocks_written += 1
                if seg:
                    placed[b] = (seg, prefix)
                blocks.append({**bm, "seg": seg or None, "prefix": prefix})
            arrays[f"t{i}_hot_ts"] = hot_ts
            arrays[f"t{i}_hot_vals"] = hot_vals
            for name, a in state.items():
                arrays[f"t{i}_{name}"] = a
            arrays[f"t{i}_keys"] = self._keys_of(tab, version, keys)
            tables.append({"name": tab.name, "capacity": capacity, "seq": seq, "blocks": blocks})
        meta = {"version": FORMAT_VERSION, "saved_at": time.time(), "tables": tables}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        if segment:
            stats.bytes_written += _write_npz(state_dir / seg_name, segment)
        stats.bytes_written += _write_npz(path, arrays)
        _fsync_dir(state_dir)
        # The manifest is in place: the segments it names are what is on disk; the others can go.
        self._on_disk = placed
        keep = {v[0] for v in placed.values()}
        for f in state_dir.glob(f"{SEGMENT_PREFIX}*.npz"):
            if f.name not in keep:
                f.unlink(missing_ok=True)
        # Temporary files of a process killed while writing (one agent per state_dir: the instance lock)
        for f in state_dir.glob(".store.*.tmp"):
            f.unlink(missing_ok=True)
        for name in [n for n, c in self._keys.items() if store.tables.get(n) is not c[0]]:
            del self._keys[name]
        return path

    def restore(self, store: Store, state_dir: Path, interval_of=lambda table: 1.0, now: float | None = None,
                future_tolerance_seconds: float = 5.0) -> RestoreResult:
        """:func:`restore`, remembering the restored blocks' segments (kept by the next checkpoints)."""
        with self._lock:
            placed: dict[Block, tuple[str, str]] = {}
            res = restore(store, state_dir, interval_of, now, future_tolerance_seconds, placed=placed)
            if res.restored:
                self._on_disk = placed
            return res


def save(store: Store, state_dir: Path) -> Path:
    """A full checkpoint in one file: every block in the manifest (segments of earlier checkpoints are removed)."""
    return Checkpointer(segments=False).save(store, state_dir)


def restore(store: Store, state_dir: Path, interval_of=lambda table: 1.0, now: float | None = None,
            future_tolerance_seconds: float = 5.0,
            placed: dict[Block, tuple[str, str]] | None = None) -> RestoreResult:
    """Load a checkpoint into an empty store. Never raises on a bad file, whatever is wrong with it (torn,
    flipped bytes, wrong types or shapes, a file that is not a checkpoint): reports it and moves it aside, so
    the agent starts. Rows from after ``now`` (+ tolerance: the wall clock was set back since the checkpoint
    was written) are dropped and reported: appending after them would be refused as out of order.
    ``placed`` receives block -> (segment name, array prefix) for every restored block that lives in a segment."""
    path = Path(state_dir) / FILENAME
    try:
        if not path.exists():
            return RestoreResult(False)
        n = _load(store, path, interval_of, placed if placed is not None else {})
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


def _segment(state_dir: Path, name, segments: dict[str, dict]) -> dict:
    """The arrays of a segment a manifest names (loaded once per restore)."""
    if not (isinstance(name, str) and name.startswith(SEGMENT_PREFIX) and name.endswith(".npz")
            and "/" not in name):
        raise ValueError(f"a block names the segment {name!r}, not a checkpoint segment's name")
    if name not in segments:
        with np.load(state_dir / name, allow_pickle=False) as z:
            segments[name] = {k: z[k] for k in z.files}
    return segments[name]


def _load(store: Store, path: Path, interval_of, placed: dict) -> int:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if not isinstance(meta, dict) or not isinstance(meta.get("tables"), list):
            raise ValueError(f"meta is a {type(meta).__name__} without a list of tables, not a checkpoint's")
        version = meta.get("version")
        if version not in (1, 2, 3, 4, FORMAT_VERSION):
            raise ValueError(f"unsupported checkpoint version {version!r}")
        loaded = {name: z[name] for name in z.files}
    total = 0
    segments: dict[str, dict] = {}
    with store.lock:
        for i, tm in enumerate(meta["tables"]):
            # Size from the current retention, which may differ from when it was saved.
            cap = store.capacity_for(interval_of(tm["name"]))
            if version == 1:
                total += _load_table_v1(store, tm, i, loaded, cap)
            else:
                total += _load_table(store, tm, i, loaded, cap, path.parent, segments, placed)
    return total


def _key(k) -> tuple:
    return (str(k[0]), tuple((str(a), str(b)) for a, b in k[1]))


def _load_table(store: Store, tm: dict, i: int, loaded: dict, cap: int, state_dir: Path, segments: dict[str, dict],
                placed: dict) -> int:
    """Formats 2 to 5 (format 2: keys in the meta, every block in the one file; 3: no gap bitmaps; 4: no sparse
    columns)."""
    if "keys" in tm:  # format 2
        if not isinstance(tm["keys"], list):
            raise ValueError(f"table {tm['name']!r}: keys are a {type(tm['keys']).__name__}, not a list")
        keys = [None if k is None else _key(k) for k in tm["keys"]]
    else:
        keys = decode_keys(bytes(loaded[f"t{i}_keys"]))
    blocks = []
    for j, bm in enumerate(tm["blocks"]):
        seg = bm.get("seg")
        prefix = bm.get("prefix", f"t{i}_b{j}_")
        if not isinstance(prefix, str):
            raise ValueError(f"table {tm['name']!r}: block {j} has the prefix {prefix!r}")
        b = Block.from_arrays(loaded if seg is None else _segment(state_dir, seg, segments), prefix, bm)
        if seg is not None:
            placed[b] = (seg, prefix)
        blocks.append(b)
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
