"""Embedded time-series store: numpy row blocks grouped into tables.

A *table* holds the series written together by one source (a collector run): rows of one timestamp and
one value per series (columns). Sharing the time axis turns a collector's write and a heatmap's read into
vector operations. The newest rows sit uncompressed in a "hot" block that takes the writes; every
``BLOCK_ROWS`` rows (fewer in a wide table: :func:`block_rows_for`) it is sealed into a compressed
:class:`Block` (lossless coding per column, see there), so a stored sample takes a few bytes instead of
eight. Rows older than the retention are dropped a block at a time (and hidden from reads row by row). A
series that is not written in a row holds NaN there. Columns whose series have not been written for a whole
retention period are reused.

Thread safety: one lock per store; writes are short (a row assignment), queries copy what they read.
"""

from __future__ import annotations

import math
import threading
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

Labels = tuple[tuple[str, str], ...]


class LabelMatcher(Protocol):
    """What :meth:`Store.select` needs of a matcher (store/query.py's ``Matcher`` is one); a protocol, so the store
    does not import the query layer that imports it."""

    @property
    def label(self) -> str: ...
    @property
    def op(self) -> str: ...
    @property
    def value(self) -> str: ...
    def matches(self, labels: Mapping[str, str]) -> bool: ...


def labels_key(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


class LabelSet(Mapping[str, str]):
    """A label set as the store keys it (sorted ``(name, value)`` pairs, values as text), read as a mapping: what a
    collector hands the store for series it keeps for long, instead of a dict per series. The store interns the
    pairs when it first sees the set (:meth:`Store.append_columns`, :meth:`Store.append`) and the set then holds
    the store's own tuple, so the labels are held once: a container's six PSI series took a dict of eight labels
    each (272 bytes) besides the store's tuple."""

    __slots__ = ("_pairs",)

    def __init__(self, labels: Mapping[str, str]) -> None:
        self._pairs: Labels = labels_key(labels)

    @property
    def pairs(self) -> Labels:
        return self._pairs

    def share(self, pairs: Labels) -> None:
        """Hold ``pairs`` (the store's interned tuple, equal to this set's) instead of this set's own copy."""
        if pairs != self._pairs:
            raise ValueError(f"{pairs!r} is not the label set {self._pairs!r}")
        self._pairs = pairs

    def __getitem__(self, name: str) -> str:
        for k, v in self._pairs:
            if k == name:
                return v
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)

    def __repr__(self) -> str:
        return f"LabelSet({dict(self._pairs)!r})"


@dataclass(frozen=True, slots=True)
class SeriesRef:
    metric: str
    labels: Labels
    table: str
    col: int

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)


# -- compressed blocks ------------------------------------------------------------------------------
_BYTE_SHIFTS = (np.arange(8, dtype=np.uint64) * np.uint64(8))


UNPACKED_KEEP_BYTES = 1 << 20  # unpacked first values and groups kept for the blocks read last


class _Unpacked:
    """The blocks holding their first values and groups unpacked: the ones read last, up to ``limit`` bytes (a
    query or merge reads a table's blocks again and again, column slice by slice; one cgroup block at 1,000
    containers unpacks to 117 kB). The blocks are held weakly: one dropped from its table goes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: deque[tuple[weakref.ref, int]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()

    def hold(self, b: Block, nbytes: int) -> None:
        with self._lock:
            self._held.append((weakref.ref(b), nbytes))
            self._bytes += nbytes
            while self._bytes > self.limit and len(self._held) > 1:
                ref, k = self._held.popleft()
                self._bytes -= k
                old = ref()
                if old is not None:
                    old._first = old._gid = None  # (a reader that has the arrays keeps them)


_UNPACKED = _Unpacked(UNPACKED_KEEP_BYTES)


class Block:
    """``n`` sealed rows of a table, compressed losslessly column by column.

    Each column is stored as its first value and then the XOR of every value with the one before it (the
    idea of Gorilla, Pelkonen et al., VLDB 2015), but vectorised: per column, only the byte range in which
    any of those XORs differs from zero is kept (``width`` bytes from byte ``shift``), so a constant series
    costs nothing, an integer-valued counter or gauge a few bytes, and a noisy float about seven. Columns
    with the same (shift, width) share one group whose payload is laid out as byte planes, column by column
    (``planes[g, j, row]`` is byte ``shift + j`` of row ``row + 1``'s XOR; a group of all 8 bytes keeps the
    XORs as uint64), so that decoding writes whole planes into the right byte of a uint64 view and one XOR
    scan restores the values.
    A column whose values are all k / 10**d exactly, for integers k and d in ``SCALES`` (CPU seconds made
    from µs or ns counters, bytes, counts), is coded instead as the steps of k less the smallest step, when
    that is narrower: a steady counter then costs nothing, CPU seconds about three bytes. Every choice is
    checked at encode time to come back bit for bit. Timestamps, shared by all columns, are kept as they are.
    A column with gaps (NaN: not written in some rows, as a container's RDT series while RMIDs rotate) is coded
    with each gap holding the value before it (or after it, at the start), and the gaps kept as a bitmap of the
    rows (``gapcols``, ``gapbits``: a bit a row), so that a gauge that is either its value or absent costs its
    bitmap instead of two XOR bytes a row. Only the NaN Python and numpy write (``np.nan``'s bits) is coded so;
    a column holding another NaN keeps its XOR coding, which is exact for any bits.
    A column whose codes (XORs or steps) are zero in most rows — a counter that steps a few times in the block — is
    kept instead as a bitmap of the rows with a non-zero code and those codes (:class:`_Sparse`), when that takes
    less: the byte planes would spend its widest code's bytes on every row.
    Per column a block keeps its first value (8 bytes) and its group (1 byte, 2 past 127 groups); its place in the
    group is its rank among the group's columns (:attr:`pos`, worked out when read: held, it took 2 bytes a column
    and block, ~0.4 MB at 1,000 containers). A delta-coded column also has its smallest step (``base``, 8 bytes,
    held per group: ``base[boff[g] + pos]``).
    """

    # ``first`` and ``gid`` are kept packed (zlib, level 1) and unpacked when read, the last blocks read staying
    # unpacked up to UNPACKED_KEEP_BYTES (:class:`_Unpacked`): they were 1.59 of the 2.65 MiB of sealed blocks at
    # 1,000 containers filled to full retention, and packed take 0.13 MiB (many columns start at the same value);
    # unpacking all of them takes ~1.4 ms.
    __slots__ = ("seq0", "n", "t_first", "t_last", "ncols", "ts", "_zfirst", "_zgid", "_gid_type", "_first", "_gid",
                 "groups", "base", "boff", "gapcols", "gapbits", "sparse", "__weakref__")
    _first: np.ndarray | None
    _gid: np.ndarray | None

    @property
    def first(self) -> np.ndarray:
        """Each column's first value's bits (uint64; read-only)."""
        a = self._first
        return a if a is not None else self._unpack()[0]

    @first.setter
    def first(self, a: np.ndarray) -> None:
        self._zfirst = zlib.compress(np.ascontiguousarray(a, dtype=np.uint64).tobytes(), 1)
        self._first = self._gid = None

    @property
    def gid(self) -> np.ndarray:
        """Each column's group (int8, or int16 past 127 groups; read-only)."""
        a = self._gid
        return a if a is not None else self._unpack()[1]

    @gid.setter
    def gid(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a)
        self._zgid, self._gid_type = zlib.compress(a.tobytes(), 1), a.dtype
        self._first = self._gid = None

    def _unpack(self) -> tuple[np.ndarray, np.ndarray]:
        first = np.frombuffer(zlib.decompress(self._zfirst), dtype=np.uint64)
        gid = np.frombuffer(zlib.decompress(self._zgid), dtype=self._gid_type)
        self._first, self._gid = first, gid
        _UNPACKED.hold(self, first.nbytes + gid.nbytes)
        return first, gid

    def __init__(self, seq0: int, ts: np.ndarray, vals: np.ndarray):
        if not np.little_endian:  # pragma: no cover - x86 and arm64 hosts are little-endian
            raise RuntimeError("the store's block codec assumes a little-endian host")
        self.seq0 = seq0
        self.n = len(ts)
        self.ts = np.array(ts, dtype=np.float64)
        self.t_first, self.t_last = float(self.ts[0]), float(self.ts[-1])
        self.ncols = vals.shape[1]
        filled, self.gapcols, self.gapbits = _fill_gaps(vals)
        self.first, gid, self.groups, base, self.sparse = _encode(filled)
        self.gid, self.base, self.boff = _narrow(gid, base, self.groups)

    @property
    def pos(self) -> np.ndarray:
        """Each column's place in its group's payload (and steps): its rank among the group's columns, which are
        laid out in column order."""
        return _positions(self.gid)

    def nbytes(self) -> int:
        return (self.ts.nbytes + len(self._zfirst) + len(self._zgid) + self.base.nbytes
                + self.gapcols.nbytes + self.gapbits.nbytes + sum(g[2].nbytes for g in self.groups)
                + self.sparse.nbytes())

    def width_of(self, col: int) -> int:
        """Bytes kept per row for a column (0: constant over the block, or never written; a sparse column's
        bitmap and codes over its rows, rounded up)."""
        g = int(self.gid[col])
        if g == _SPARSE:
            return self.sparse.bytes_of(col, self.n)
        return 0 if g < 0 else self.groups[g][1]

    def columns(self, cols: np.ndarray) -> np.ndarray:
        """Values of ``cols`` (n × len(cols)); a column added after the block was sealed reads NaN."""
        out = np.empty((len(cols), self.n))
        self.decode_into(np.asarray(cols, dtype=np.int64), out)
        return out.T

    def decode_into(self, cols: np.ndarray, out: np.ndarray) -> None:
        """Write the values of ``cols`` into ``out`` (float64, len(cols) × n, rows contiguous): one row per
        column, as the byte planes are laid out."""
        inside = cols < self.ncols
        if inside.all():
            _decode(self, cols, out)
            _ungap(self, cols, out)
        else:
            out[:] = np.nan
            if inside.any():
                tmp = np.empty((int(inside.sum()), self.n))
                _decode(self, cols[inside], tmp)
                _ungap(self, cols[inside], tmp)
                out[inside] = tmp

    # -- checkpoint form: flat arrays plus a little JSON ---------------------------------------------
    def to_arrays(self, prefix: str) -> tuple[dict[str, np.ndarray], dict]:
        arrays = {f"{prefix}ts": self.ts, f"{prefix}first": self.first, f"{prefix}gid": self.gid,
                  f"{prefix}pos": self.pos, f"{prefix}base": self.base}
        for g, (_, _, planes, _) in enumerate(self.groups):
            arrays[f"{prefix}g{g}"] = planes
        meta = {"seq0": self.seq0, "n": self.n, "ncols": self.ncols, "base": "groups",
                "groups": [[int(s), int(w), int(mode)] for s, w, _, mode in self.groups]}
        if len(self.gapcols):
            arrays[f"{prefix}gapcols"], arrays[f"{prefix}gapbits"] = self.gapcols, self.gapbits
            meta["gaps"] = True
        if len(self.sparse.cols):
            arrays.update(self.sparse.to_arrays(prefix))
            meta["sparse"] = True
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays, prefix: str, meta: dict) -> Block:
        """Inverse of :meth:`to_arrays`; raises ValueError on arrays that do not fit together."""
        b = cls.__new__(cls)
        b.seq0, b.n, b.ncols = int(meta["seq0"]), int(meta["n"]), int(meta["ncols"])
        b.ts = np.asarray(arrays[f"{prefix}ts"])
        first, gid, pos, b.base = (np.asarray(arrays[f"{prefix}{k}"]) for k in ("first", "gid", "pos", "base"))
        if b.n < 1 or b.ts.shape != (b.n,) or b.ts.dtype != np.float64:
            raise ValueError(f"block {prefix}: {b.ts.shape} timestamps for {b.n} rows")
        per_group = meta.get("base") == "groups"  # (format 3: a base for every column)
        if not (first.shape == gid.shape == pos.shape == (b.ncols,)) or b.base.ndim != 1 \
                or (not per_group and b.base.shape != (b.ncols,)) \
                or first.dtype != np.uint64 or b.base.dtype != np.int64 \
                or gid.dtype not in (np.int8, np.int16) or pos.dtype not in (np.uint16, np.int32):
            raise ValueError(f"block {prefix}: column arrays do not match {b.ncols} columns")
        b.first, b.gid = first, gid
        b.groups = []
        places = []  # per group, its members' places in the file (ascending columns)
        for g, (s, w, mode) in enumerate(meta["groups"]):
            planes = np.asarray(arrays[f"{prefix}g{g}"])
            members = b.gid == g
            k = int(members.sum())
            shape, dtype = ((k, b.n - 1), np.uint64) if w == 8 else ((k, w, b.n - 1), np.uint8)
            if not (s >= 0 and (1 if mode == _XOR else 0) <= w and s + w <= 8) or planes.shape != shape \
                    or planes.dtype != dtype or mode not in (_XOR, *SCALES):
                raise ValueError(f"block {prefix}: group {g} (bytes {s}+{w}) has payload shape {planes.shape}")
            places.append(pos[members].astype(np.int64))
            if k and not np.array_equal(np.sort(places[-1]), np.arange(k)):
                raise ValueError(f"block {prefix}: group {g}: column positions out of range")
            b.groups.append((int(s), int(w), planes, int(mode)))
        b.sparse = _Sparse.from_arrays(arrays, prefix, b.n, b.ncols) if meta.get("sparse") else _Sparse.empty(b.n)
        if (b.gid >= len(b.groups)).any() or (b.gid < _SPARSE).any() \
                or not np.array_equal(np.flatnonzero(b.gid == _SPARSE), b.sparse.cols):
            raise ValueError(f"block {prefix}: a column names a group that does not exist")
        # Payloads (and steps) laid out in column order, as :attr:`pos` reads them: a file's positions may be any
        # order within a group (the encoders write column order, so this is a no-op for their files).
        b.groups = [(s, w, planes if np.array_equal(at, np.arange(len(at))) else planes[at], mode)
                    for (s, w, planes, mode), at in zip(b.groups, places, strict=True)]
        if per_group:
            b.boff = _base_offsets(b.groups)
            if len(b.base) != sum(len(g[2]) for g in b.groups if g[3] != _XOR):
                raise ValueError(f"block {prefix}: {len(b.base)} steps for the delta-coded columns")
            b.base = np.concatenate([b.base[b.boff[g] + at] for g, ((_, _, _, mode), at)
                                     in enumerate(zip(b.groups, places, strict=True)) if mode != _XOR]
                                    or [np.zeros(0, dtype=np.int64)])
            b.gid = b.gid.astype(np.int8 if len(b.groups) <= 127 else np.int16)
        else:
            b.gid, b.base, b.boff = _narrow(b.gid, b.base, b.groups)
        if meta.get("gaps"):
            b.gapcols, b.gapbits = np.asarray(arrays[f"{prefix}gapcols"]), np.asarray(arrays[f"{prefix}gapbits"])
            k = len(b.gapcols)
            if b.gapcols.dtype != np.int32 or b.gapcols.shape != (k,) or b.gapbits.dtype != np.uint8 \
                    or b.gapbits.shape != (k, (b.n + 7) // 8) or (k and not (
                        b.gapcols[0] >= 0 and b.gapcols[-1] < b.ncols and (np.diff(b.gapcols) > 0).all())):
                raise ValueError(f"block {prefix}: gap bitmap of shape {b.gapbits.shape} for columns "
                                 f"{b.gapcols.shape} does not fit {b.ncols} columns of {b.n} rows")
        else:
            b.gapcols, b.gapbits = _no_gaps(b.n)
        b.t_first, b.t_last = float(b.ts[0]), float(b.ts[-1])
        return b


SCALES = (0, 3, 6, 9)  # decimal digits tried for the delta coding: integers, milli, micro, nano
_XOR = -1


_NAN_BITS = np.array([np.nan]).view(np.uint64)[0]  # the NaN np.nan and float("nan") are


_SPARSE = -2  # a column's gid when its codes are kept sparse (:class:`_Sparse`)


class _Sparse:
    """The columns of a block whose codes (the XORs, or the steps less the smallest) are mostly zero, kept as a
    bitmap of the rows with a non-zero code (rows 1..n-1, a bit a row: ``bits[i]``, as ``np.packbits``) and those
    codes whole (``codes[off[i]:off[i + 1]]``, uint64, in row order): a counter that steps a few times in a block
    (an idle container's, one that counts only while watched) costs its bitmap and 8 bytes a step instead of its
    widest step's bytes in every row. Gorilla spends a bit on an unchanged value for the same reason. Per column
    also its coding (``mode``: _XOR or a scale of SCALES) and, for a delta-coded one, its smallest step."""

    __slots__ = ("cols", "mode", "base", "bits", "codes", "off")

    def __init__(self, cols: np.ndarray, mode: np.ndarray, base: np.ndarray, bits: np.ndarray, codes: np.ndarray,
                 off: np.ndarray):
        self.cols, self.mode, self.base, self.bits, self.codes, self.off = cols, mode, base, bits, codes, off

    @classmethod
    def empty(cls, n: int) -> _Sparse:
        return cls(np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int8), np.zeros(0, dtype=np.int64),
                   np.zeros((0, (max(n - 1, 0) + 7) // 8), dtype=np.uint8), np.zeros(0, dtype=np.uint64),
                   np.zeros(1, dtype=np.int64))

    @classmethod
    def of(cls, d: np.ndarray, cols: np.ndarray, mode: np.ndarray, base: np.ndarray) -> _Sparse:
        """The codes ``d`` (n-1 rows × columns) of ``cols``."""
        sub = d[:, cols].T  # (k, n-1)
        nz = sub != 0
        off = np.zeros(len(cols) + 1, dtype=np.int64)
        np.cumsum(nz.sum(axis=1), out=off[1:])
        return cls(cols.astype(np.int32), mode.astype(np.int8), base.astype(np.int64), np.packbits(nz, axis=1),
                   np.ascontiguousarray(sub[nz]), off)

    @classmethod
    def joined(cls, parts: Sequence[_Sparse]) -> _Sparse:
        """The sparse columns of ``parts`` (of the same rows, columns ascending from part to part) as one."""
        shift = np.cumsum([0] + [len(sp.codes) for sp in parts[:-1]])
        off = np.concatenate([np.zeros(1, dtype=np.int64)]
                             + [sp.off[1:] + k for sp, k in zip(parts, shift, strict=True)])
        return cls(np.concatenate([sp.cols for sp in parts]), np.concatenate([sp.mode for sp in parts]),
                   np.concatenate([sp.base for sp in parts]), np.concatenate([sp.bits for sp in parts]),
                   np.concatenate([sp.codes for sp in parts]), off.astype(np.int64))

    @staticmethod
    def cost(n: int, nnz: np.ndarray) -> np.ndarray:
        """Bytes a sparse column of a block of ``n`` rows with ``nnz`` non-zero codes takes (bitmap, codes, its
        column, coding, smallest step and offset)."""
        return (n - 1 + 7) // 8 + 8 * nnz + 21

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.cols, self.mode, self.base, self.bits, self.codes, self.off))

    def bytes_of(self, col: int, n: int) -> int:
        i = int(np.searchsorted(self.cols, col))
        return -(-(self.bits.shape[1] + 8 * int(self.off[i + 1] - self.off[i])) // max(n - 1, 1))

    def place(self, cols: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write the codes of the sparse ones among ``cols`` into rows of ``x`` (len(cols) × n, from the second
        value on); return those rows, and their codings and smallest steps."""
        at = np.searchsorted(self.cols, cols)
        at[at >= len(self.cols)] = 0
        hit = np.flatnonzero(self.cols[at] == cols) if len(self.cols) else np.zeros(0, dtype=np.int64)
        if len(hit) == 0:
            return hit, self.mode[:0], self.base[:0]
        i = at[hit]
        n1 = x.shape[1] - 1
        nz = np.unpackbits(self.bits[i], axis=1, count=n1).astype(bool)
        lengths = self.off[i + 1] - self.off[i]
        starts = np.repeat(self.off[i] - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
        sub = np.zeros((len(hit), n1), dtype=np.uint64)
        sub[nz] = self.codes[starts + np.arange(int(lengths.sum()))]
        x[hit, 1:] = sub
        return hit, self.mode[i], self.base[i]

    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}sp{k}": getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_arrays(cls, arrays, prefix: str, n: int, ncols: int) -> _Sparse:
        """Inverse of :meth:`to_arrays`; raises ValueError on arrays that do not fit a block of ``n`` rows and
        ``ncols`` columns."""
        sp = cls(*(np.asarray(arrays[f"{prefix}sp{k}"]) for k in cls.__slots__))
        k = len(sp.cols)
        if sp.cols.dtype != np.int32 or sp.cols.shape != (k,) or (k and not (
                sp.cols[0] >= 0 and sp.cols[-1] < ncols and (np.diff(sp.cols) > 0).all())) \
                or sp.mode.dtype != np.int8 or sp.mode.shape != (k,) or not np.isin(sp.mode, (_XOR, *SCALES)).all() \
                or sp.base.dtype != np.int64 or sp.base.shape != (k,) \
                or sp.bits.dtype != np.uint8 or sp.bits.shape != (k, (max(n - 1, 0) + 7) // 8) \
                or sp.codes.dtype != np.uint64 or sp.codes.ndim != 1 \
                or sp.off.dtype != np.int64 or sp.off.shape != (k + 1,) or sp.off[0] != 0 \
                or sp.off[-1] != len(sp.codes) \
                or not np.array_equal(np.diff(sp.off), np.unpackbits(sp.bits, axis=1, count=max(n - 1, 0)).sum(axis=1)):
            raise ValueError(f"block {prefix}: sparse columns of shapes {sp.cols.shape}, {sp.bits.shape}, "
                             f"{sp.codes.shape} do not fit {ncols} columns of {n} rows")
        return sp


def _base_offsets(groups) -> list[int]:
    """Per group, where its members' steps start in a block's ``base`` (-1 for an XOR group: none)."""
    out, off = [], 0
    for g in groups:
        if g[3] == _XOR:
            out.append(-1)
        else:
            out.append(off)
            off += len(g[2])
    return out


def _narrow(gid: np.ndarray, base: np.ndarray, groups):
    """A block's per-column arrays as kept: ``gid`` in the narrowest type that holds it, ``base`` (one per column)
    only for the delta-coded columns, group by group in the order of their positions (ascending columns)."""
    gid = gid.astype(np.int8 if len(groups) <= 127 else np.int16)
    delta = [np.flatnonzero(gid == g) for g, grp in enumerate(groups) if grp[3] != _XOR]
    base = np.concatenate([base[c] for c in delta]) if delta else np.zeros(0, dtype=np.int64)
    return gid, base.astype(np.int64), _base_offsets(groups)


def _positions(gid: np.ndarray) -> np.ndarray:
    """Per column, its rank among the columns of the same group (the checkpoint's ``pos``, in its types)."""
    order = np.argsort(gid, kind="stable")
    s = gid[order]
    pos = np.empty(len(gid), dtype=np.uint16 if len(gid) <= 65536 else np.int32)
    pos[order] = np.arange(len(gid)) - np.searchsorted(s, s, side="left")
    return pos


def _no_gaps(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, dtype=np.int32), np.zeros((0, (n + 7) // 8), dtype=np.uint8)


def _fill_gaps(vals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``vals`` (rows × columns) with the gaps of each column that has some (NaN rows, with values in others,
    every NaN the one of ``np.nan``) holding the value before them (the first value, before the first); those
    columns (ascending) and their gaps' rows as bits (``np.packbits`` per column: row r is bit 7 - r % 8 of byte
    r // 8). ``vals`` itself when there are none."""
    nan = np.isnan(vals)
    n = len(vals)
    cols = np.flatnonzero(nan.any(axis=0) & ~nan.all(axis=0))
    if len(cols) == 0:
        return vals, *_no_gaps(n)
    sub = vals[:, cols]
    holes = nan[:, cols]
    odd = (holes & (sub.view(np.uint64) != _NAN_BITS)).any(axis=0)  # another NaN: its bits are kept by XOR
    if odd.any():
        cols, sub, holes = cols[~odd], sub[:, ~odd], holes[:, ~odd]
        if len(cols) == 0:
            return vals, *_no_gaps(n)
    sub[0] = sub[np.argmax(~holes, axis=0), np.arange(len(cols))]  # before the first value: the first value
    for r in range(1, n):  # (a row at a time: a few dozen vector copies, cheaper than index arithmetic)
        np.copyto(sub[r], sub[r - 1], where=holes[r])
    filled = np.array(vals, dtype=np.float64, order="C")
    filled[:, cols] = sub
    return filled, cols.astype(np.int32), np.packbits(holes.T, axis=1)


def _ungap(b: Block, cols: np.ndarray, out: np.ndarray) -> None:
    """NaN back into the gaps of the columns ``cols`` (all < b.ncols) decoded into ``out`` (len(cols) × n)."""
    gc = b.gapcols
    if len(gc) == 0:
        return
    at = np.searchsorted(gc, cols)
    at[at >= len(gc)] = 0
    hit = np.flatnonzero(gc[at] == cols)
    if len(hit) == 0:
        return
    holes = np.unpackbits(b.gapbits[at[hit]], axis=1, count=b.n).astype(bool)
    if len(hit) == len(cols):
        out[holes] = np.nan
    else:
        sub = out[hit]
        sub[holes] = np.nan
        out[hit] = sub


def _trim(u: np.ndarray):
    """Per column of ``u`` (rows × columns, uint64): (lowest byte set in any row, bytes from there to the
    highest byte set); width 0 where every row is 0."""
    acc = np.bitwise_or.reduce(u, axis=0)
    nz = ((acc[:, None] >> _BYTE_SHIFTS) & np.uint64(0xFF)) != 0  # (c, 8)
    anyset = nz.any(axis=1)
    lo = np.argmax(nz, axis=1)
    width = np.where(anyset, 8 - np.argmax(nz[:, ::-1], axis=1) - lo, 0)
    return np.where(anyset, lo, 0), width


def _scaled_deltas(vals: np.ndarray, cols: np.ndarray):
    """For the columns ``cols`` of ``vals``: the smallest scale d of SCALES with vals == k / 10**d exactly
    (bit for bit, k integers below 2**53), the deltas of k less their minimum, and that minimum. Columns
    with no such d get scale -1."""
    v = vals[:, cols]
    scale = np.full(len(cols), _XOR, dtype=np.int8)
    zz = np.zeros((len(vals) - 1, len(cols)), dtype=np.uint64)
    k0 = np.zeros(len(cols), dtype=np.int64)
    base = np.zeros(len(cols), dtype=np.int64)
    todo = np.isfinite(v).all(axis=0)
    for d in SCALES:
        if not todo.any():
            break
        f = 10.0 ** d
        idx = np.flatnonzero(todo)
        with np.errstate(over="ignore", invalid="ignore"):
            k = np.rint(v[:, idx] * f)
            ok = (np.abs(k) < 2.0 ** 53).all(axis=0)
            ok &= ((k / f).view(np.uint64) == v[:, idx].view(np.uint64)).all(axis=0)
        if not ok.any():
            continue
        hit = idx[ok]
        ki = k[:, ok].astype(np.int64)
        delta = np.diff(ki, axis=0)
        mn = delta.min(axis=0)
        zz[:, hit] = (delta - mn).view(np.uint64)  # >= 0: byte trimming keeps only the spread
        base[hit] = mn
        k0[hit] = ki[0]
        scale[hit] = d
        todo[hit] = False
    return scale, zz, k0, base


def _encode(vals: np.ndarray):
    vals = np.ascontiguousarray(vals, dtype=np.float64)
    x = vals.view(np.uint64)
    n, c = x.shape
    first = x[0].copy()
    gid = np.full(c, -1, dtype=np.int16)
    groups: list[tuple[int, int, np.ndarray, int]] = []
    base = np.zeros(c, dtype=np.int64)
    if n == 1 or c == 0:
        return first, gid, groups, base, _Sparse.empty(n)
    d = x[1:] ^ x[:-1]  # (n-1, c)
    lo, width = _trim(d)
    scale = np.full(c, _XOR, dtype=np.int8)
    # Counters and gauges of decimal resolution (CPU seconds in µs, bytes) code better as integer deltas.
    cand = np.flatnonzero(width >= 2)
    if len(cand):
        sc, zz, k0, mn = _scaled_deltas(vals, cand)
        zlo, zwidth = _trim(zz)
        better = (sc != _XOR) & (zwidth < width[cand])
        if better.any():
            cols = cand[better]
            d[:, cols] = zz[:, better]
            lo[cols], width[cols], scale[cols] = zlo[better], zwidth[better], sc[better]
            first[cols] = k0[better].view(np.uint64)
            base[cols] = mn[better]
    # Mostly-zero codes (a counter that steps a few times in the block) kept sparse where that takes less.
    wide = np.flatnonzero(width > 0)
    if len(wide):
        nnz = np.count_nonzero(d[:, wide], axis=0)
        wide = wide[_Sparse.cost(n, nnz) < width[wide] * (n - 1)]
    sparse = _Sparse.of(d, wide, scale[wide], base[wide]) if len(wide) else _Sparse.empty(n)
    gid[wide] = _SPARSE
    # A group per (coding, first byte, width); XOR columns of width 0 are constant and need none, but a
    # delta column of width 0 (a constant step: a steady counter) keeps its group for its step.
    code = np.where((width > 0) | (scale != _XOR), ((scale.astype(np.int64) + 1) * 9 + lo) * 9 + width, -1)
    code[wide] = -1
    b = d.view(np.uint8).reshape(n - 1, c, 8)  # little-endian: byte 0 is the least significant
    for key in np.unique(code):
        if key < 0:
            continue
        rest, w = divmod(int(key), 9)
        mode, sh = divmod(rest, 9)
        cols = np.flatnonzero(code == key)
        gid[cols] = len(groups)
        if w == 8:  # all bytes: the codes as they are, (g, n-1) uint64
            planes = np.ascontiguousarray(d[:, cols].T)
        else:
            planes = np.ascontiguousarray(b[:, cols, sh:sh + w].transpose(1, 2, 0))  # (g, w, n-1)
        groups.append((sh, w, planes, mode - 1))
    return first, gid, groups, base, sparse


def _undelta(x: np.ndarray, base, d: int, out: np.ndarray) -> None:
    """Rows of ``x`` (uint64: k0, then deltas less ``base``) back to values k / 10**d, into ``out`` (which
    may be ``x``'s own memory)."""
    k = x.view(np.int64)
    if np.ndim(base) == 0:
        if base:
            k[1:] += base
    elif base.any():
        k[..., 1:] += base[:, None]
    np.add.accumulate(k, axis=-1, out=k)  # (cumsum takes a slower path with out=)
    out[...] = k
    if d:
        out /= 10.0 ** d


def _place(x: np.ndarray, xb: np.ndarray, rows, group, src) -> None:
    """Write a group's codes ``src`` into rows ``rows`` (index or slice) of x, from the second value on."""
    s, w = group[0], group[1]
    if w == 8:
        x[rows, 1:] = src
    else:
        for j in range(w):
            xb[rows, 1:, s + j] = src[:, j, :]


def _decode_one(b: Block, col: int, out: np.ndarray) -> None:
    """:func:`_decode` of a single column (``out``: n values): the single-series read, without the
    grouping work."""
    x = out.view(np.uint64)
    g = int(b.gid[col])
    if g == _SPARSE:  # (placed by _Sparse.place, as in a read of several columns)
        _decode(b, np.array([col]), out[None])
        return
    if g < 0:  # constant over the block
        x[:] = b.first[col]
        return
    group = b.groups[g]
    at = int(np.count_nonzero(b.gid[:col] == g))  # (its place in the group: :attr:`Block.pos`)
    x[0] = b.first[col]
    x[1:] = 0
    x2 = x.reshape(1, b.n)
    _place(x2, x2.view(np.uint8).reshape(1, b.n, 8), slice(None), group, group[2][at][None])
    if group[3] == _XOR:
        np.bitwise_xor.accumulate(x, out=x)
    else:
        _undelta(x, b.base[b.boff[g] + at], group[3], out)


def _decode(b: Block, cols: np.ndarray, out: np.ndarray) -> None:
    n, k = b.n, len(cols)
    if k == 1 and b.gid[cols[0]] != _SPARSE:
        _decode_one(b, int(cols[0]), out[0])
        return
    x = out.view(np.uint64)  # (k, n); rows may be slices of a longer matrix
    x[:] = 0
    x[:, 0] = b.first[cols]
    xor_rows = np.ones(k, dtype=bool)
    deltas = []  # (rows, scale, base) of the delta-coded groups
    if n > 1 and b.groups:
        xb = x.view(np.uint8).reshape(k, n, 8)
        pos = b.pos
        gid = b.gid[cols]
        for g in np.unique(gid):
            if g < 0:
                continue
            group = b.groups[g]
            rows = np.flatnonzero(gid == g)
            sel: np.ndarray | slice = slice(None) if len(rows) == k else rows
            _place(x, xb, sel, group, group[2][pos[cols[sel]]])
            if group[3] != _XOR:
                deltas.append((sel, group[3], b.base[b.boff[g] + pos[cols[sel]].astype(np.int64)]))
                xor_rows[sel] = False
    if n > 1 and len(b.sparse.cols):
        rows, modes, bases = b.sparse.place(cols, x)
        for d in np.unique(modes[modes != _XOR]).tolist():
            mine = modes == d
            deltas.append((rows[mine], d, bases[mine]))
            xor_rows[rows[mine]] = False
    # The groups own disjoint rows: each is finished on its own.
    if xor_rows.all():
        np.bitwise_xor.accumulate(x, axis=1, out=x)
    elif xor_rows.any():
        r = np.flatnonzero(xor_rows)
        x[r] = np.bitwise_xor.accumulate(x[r], axis=1)
    for sel, d, base in deltas:
        if isinstance(sel, slice):
            _undelta(x, base, d, out)
        else:
            v = np.empty((len(sel), n))
            _undelta(x[sel], base, d, v)
            out[sel] = v



MERGE_CHUNK_VALUES = 1 << 18  # values decoded at a time when blocks are merged (2 MiB of float64)


def merge_blocks(blocks: Sequence[Block], ncols: int) -> Block:
    """One block holding the rows of ``blocks`` (consecutive, oldest first) for columns ``0..ncols-1``; a column
    a block did not have reads NaN there, as it did before. Decoded and coded again a slice of columns at a time
    (so the temporaries stay near MERGE_CHUNK_VALUES values whatever the table's width), the slices' groups joined
    by their coding. Lossless: every column is coded again by :func:`_encode`, which checks its choices."""
    n = sum(b.n for b in blocks)
    out = Block.__new__(Block)
    out.seq0, out.n, out.ncols = blocks[0].seq0, n, ncols
    out.ts = np.concatenate([b.ts for b in blocks])
    out.t_first, out.t_last = float(out.ts[0]), float(out.ts[-1])
    first_all = np.zeros(ncols, dtype=np.uint64)
    gid_all = np.full(ncols, -1, dtype=np.int16)
    base_all = np.zeros(ncols, dtype=np.int64)
    order: dict[tuple[int, int, int], int] = {}  # (shift, width, mode) -> group index in ``out``
    planes: list[list[np.ndarray]] = []
    gapcols: list[np.ndarray] = []
    gapbits: list[np.ndarray] = []
    sparse: list[_Sparse] = []
    step = max(1, MERGE_CHUNK_VALUES // max(n, 1))
    for a in range(0, ncols, step):
        cols = np.arange(a, min(a + step, ncols), dtype=np.int64)
        vt = np.empty((len(cols), n))  # column-major, as blocks decode
        off = 0
        for b in blocks:
            b.decode_into(cols, vt[:, off:off + b.n])
            off += b.n
        filled, gc, gb = _fill_gaps(vt.T)
        first, gid, groups, base, sp = _encode(filled)
        first_all[cols], base_all[cols] = first, base
        if len(sp.cols):
            sp.cols = sp.cols + np.int32(a)
            sparse.append(sp)
            gid_all[sp.cols] = _SPARSE
        if len(gc):
            gapcols.append(gc + np.int32(a))
            gapbits.append(gb)
        for g, (sh, w, pl, mode) in enumerate(groups):
            key = (sh, w, mode)
            k = order.get(key)
            if k is None:
                k = order[key] = len(planes)
                planes.append([])
            mine = gid == g
            gid_all[cols[mine]] = k
            planes[k].append(pl)
    out.groups = [(sh, w, np.concatenate(planes[k]) if len(planes[k]) > 1 else planes[k][0], mode)
                  for (sh, w, mode), k in sorted(order.items(), key=lambda kv: kv[1])]
    out.gapcols, out.gapbits = (np.concatenate(gapcols), np.concatenate(gapbits)) if gapcols else _no_gaps(n)
    out.sparse = _Sparse.empty(n) if not sparse else _Sparse.joined(sparse)
    out.first = first_all
    out.gid, out.base, out.boff = _narrow(gid_all, base_all, out.groups)
    return out


BLOCK_ROWS = 256  # rows per sealed block; the newest rows (up to this many) stay uncompressed
# A wide table (a high-cardinality source: 1,000 containers × 13 series) seals sooner, so that its hot block
# stays near HOT_BLOCK_BYTES instead of 256 rows × 8 bytes per series: at 13 k series that is 27 MB of
# uncompressed float64 against ~1 MB (2 MB before; docs/hardware-collectors.md, "Agent memory at 1,000 containers").
# Never fewer than MIN_BLOCK_ROWS rows: each sealed block is merged at once into the one before it (below), but
# that block costs ~11-19 bytes per column (first value, group, position) until it is full. 8, not 16: the cgroup
# table at 1,000 containers (16,384 columns) then keeps a hot block of 1 MiB instead of 2 (figures from before, when
# small blocks still waited to be merged together: over a simulated hour past the retention the three wide tables
# held 13.71 MiB on average, max 14.46, against 14.23, max 14.76). 512 KiB, not 1 MiB, since each block sealed is
# merged at once: RDT's and AVX-512's ~4,000 columns keep 16 rows hot instead of 32, and over the hour past the
# retention (bench/retention_bench.py) the tables held 5.10 MiB on average against 6.01, for ~0.3 s more CPU an
# hour (256 KiB: 4.64 MiB, ~1 s more). And 4 rows at least, not 8: the cgroup table's 13,000 columns then keep
# 4 rows hot (0.4 MB, not 0.8), 1.82 MiB held on average against 2.21, for ~0.35 s more CPU an hour.
HOT_BLOCK_BYTES = 1 << 19
MIN_BLOCK_ROWS = 4
# ... and each block it seals is merged into the newest sealed one until that holds compact_rows_for rows, up to
# BLOCK_ROWS (:func:`merge_blocks`, :meth:`Table.merge_tail`): the per-column cost of a block is then paid once per
# up to 256 rows, not per 8 or 32, and only the one growing block pays it for fewer. Before, the small blocks
# waited until they added up to a merged one: over an hour past the retention (bench/retention_bench.py, a
# scale_bench checkpoint at 1,000 containers) the tables held 6.37 MiB on average (6.57 at most) against 7.11
# (8.06), for ~0.65 s more CPU an hour (each merge codes the growing block again).
# A block is dropped whole once all its rows are past the retention, so a merged block holds at most
# 1/COMPACT_SHARE of the table's capacity: the rows kept past the retention stay under that share.
COMPACT_SHARE = 8


def compact_rows_for(capacity: int, block_rows: int, limit: int = BLOCK_ROWS) -> int:
    """Rows of a merged sealed block of a table of ``capacity`` rows whose hot block holds ``block_rows``: the
    largest multiple of ``block_rows`` up to ``limit`` and capacity / COMPACT_SHARE, and never fewer than
    ``block_rows`` (no merging). A multiple, not a power of two: an hour of the cgroup table at 5 s (721 rows)
    then merges into blocks of 88 rows, not 64, and each block's per-column cost (a first value, group and place:
    11 bytes for each of 13,000 series at 1,000 containers) is paid ~8 times over the retention, not ~11."""
    return max(block_rows, min(limit, capacity // COMPACT_SHARE) // block_rows * block_rows)


def block_rows_for(columns: int, limit: int = BLOCK_ROWS) -> int:
    """Rows of the hot block of a table ``columns`` wide: ``limit`` for a narrow table, fewer (a power of two,
    at least MIN_BLOCK_ROWS) where ``limit`` rows would take more than HOT_BLOCK_BYTES."""
    rows = limit
    while rows > MIN_BLOCK_ROWS and rows * columns * 8 > HOT_BLOCK_BYTES:
        rows //= 2
    return max(2, min(rows, limit))


class Table:
    """The rows of one source. Rows are numbered by ``seq`` (rows ever written); the newest ``capacity`` rows
    are kept: up to ``block_rows`` of them in an uncompressed "hot" block (float64 rows × columns) that
    takes the writes, the older ones in sealed, compressed :class:`Block` s."""

    def __init__(self, name: str, capacity: int, columns: int = 16, block_rows: int = BLOCK_ROWS):
        if capacity < 2:
            raise ValueError("table capacity must be at least 2 rows")
        self.name = name
        self.capacity = capacity
        self.max_block_rows = max(2, min(block_rows, capacity))
        ncols = max(columns, 1)
        self.block_rows = block_rows_for(ncols, self.max_block_rows)
        self.hot_ts = np.zeros(self.block_rows, dtype=np.float64)
        self.hot_vals = np.full((self.block_rows, ncols), np.nan, dtype=np.float64)
        self.hot_n = 0
        self.blocks: deque[Block] = deque()
        self.seq = 0  # rows ever written
        # per column: its series' metric and label set (None for a free column). Two lists, not a (metric, labels)
        # tuple each, and no key -> column map: the store's index finds a series' column (1,000 containers: 20 k
        # series, ~2 MB of tuples and map that the index held again).
        self.metrics: list[str | None] = []
        self.label_sets: list[Labels | None] = []
        self.last_seq = np.full(ncols, -1, dtype=np.int64)  # seq of a column's last write
        self.last_val = np.full(ncols, np.nan)  # value of that write
        self.last_t = np.full(ncols, np.nan)  # and its time
        self.since = np.zeros(ncols, dtype=np.int64)  # seq from which a column holds its current series
        self.free: list[int] = []
        self.generation = 0  # bumped whenever columns are reclaimed
        self.keys_version = 0  # bumped whenever ``keys`` changes (a checkpoint re-encodes them only then)
        self.fast_col: dict[tuple, int] = {}
        # Rows before this seq are gone whatever the capacity says (it grew on a reload, or a checkpoint held
        # fewer rows than the capacity now covers).
        self.first_seq = 0
        self.defer_merges = False  # the Store's tables: sealed blocks are merged by the Store, outside its lock
        self.merge_due = False

    @property
    def count(self) -> int:
        """Rows kept (≤ capacity)."""
        return self.seq - self.floor

    @property
    def floor(self) -> int:
        """seq of the oldest row kept."""
        return max(self.seq - self.capacity, self.first_seq, 0)

    def resize(self, capacity: int) -> None:
        """Keep ``capacity`` rows from now on (a collector's interval changed on reload: the retention stays)."""
        if capacity < 2:
            raise ValueError("table capacity must be at least 2 rows")
        self.first_seq = self.floor
        self.capacity = capacity
        self.drop_expired()

    # -- columns -----------------------------------------------------------------------------------
    def _grow(self) -> None:
        old = self.hot_vals.shape[1]
        # by a quarter (to a multiple of 64), not twice: the hot block and the per-column state are this wide,
        # and at 1,000 containers the cgroup table's 13,000 columns would take 16,384 (~0.5 MB more)
        new = -(-(old + max(old // 4, 16)) // 64) * 64
        rows = block_rows_for(new, self.max_block_rows)
        if self.hot_n >= rows:  # the hot block shrinks below the rows it holds: they are sealed first
            self._seal()
        vals = np.full((rows, new), np.nan, dtype=np.float64)
        vals[:self.hot_n, :old] = self.hot_vals[:self.hot_n]
        self.hot_vals = vals
        if rows != self.block_rows:
            ts = np.zeros(rows, dtype=np.float64)
            ts[:self.hot_n] = self.hot_ts[:self.hot_n]
            self.hot_ts, self.block_rows = ts, rows
        for name, fill, dtype in (("last_seq", -1, np.int64), ("last_val", np.nan, np.float64),
                                  ("last_t", np.nan, np.float64), ("since", 0, np.int64)):
            a = np.full(new, fill, dtype=dtype)
            a[:old] = getattr(self, name)
            setattr(self, name, a)

    @property
    def ncols(self) -> int:
        """Columns in use or free (the hot block may be wider)."""
        return len(self.metrics)

    @property
    def keys(self) -> list[tuple[str, Labels] | None]:
        """Per column its series' ``(metric, labels)``, None for a free column (a new list: for checkpoints and
        readers, not the write path)."""
        # (a column has both or neither: label_sets[col] is a label set wherever metrics[col] is not None)
        return [None if m is None else (m, lk)  # type: ignore[misc]
                for m, lk in zip(self.metrics, self.label_sets, strict=True)]

    def key(self, col: int) -> tuple[str, Labels] | None:
        m = self.metrics[col]
        return None if m is None else (m, self.label_sets[col])  # type: ignore[return-value]

    def set_keys(self, keys: Sequence[tuple[str, Labels] | None]) -> None:
        """Name every column (a checkpoint's keys); the columns named None are free."""
        self.metrics = [None if k is None else k[0] for k in keys]
        self.label_sets = [None if k is None else k[1] for k in keys]
        self.free = [c for c, k in enumerate(keys) if k is None]
        self.keys_version += 1

    def add_column(self, metric: str, labels: Labels) -> int:
        """A column for a new series (the caller knows it has none here): a free one, or one more."""
        if self.free:
            col = self.free.pop()
            self.metrics[col], self.label_sets[col] = metric, labels
        else:
            col = len(self.metrics)
            if col >= self.hot_vals.shape[1]:
                self._grow()
            self.metrics.append(metric)
            self.label_sets.append(labels)
        self.keys_version += 1
        self.hot_vals[:, col] = np.nan
        self.last_seq[col] = -1
        self.last_val[col] = self.last_t[col] = np.nan
        self.since[col] = self.seq  # older rows of this column belonged to another series
        return col

    def reclaim(self) -> list[tuple[str, Labels]]:
        """Free columns not written for a whole ring; return their keys."""
        horizon = self.seq - self.capacity
        gone = []
        for col in np.flatnonzero(self.last_seq[:self.ncols] < horizon).tolist():
            key = self.key(col)
            if key is not None:
                gone.append(key)
                self.metrics[col] = self.label_sets[col] = None
                self.free.append(col)
        if gone:
            self.generation += 1
            self.keys_version += 1
            self.fast_col.clear()
        return gone

    # -- rows --------------------------------------------------------------------------------------
    def write_row(self, t: float, cols: np.ndarray, values: np.ndarray) -> None:
        if self.hot_n == self.block_rows:
            self._seal()
        row = self.hot_n
        self.hot_ts[row] = t
        self.hot_vals[row, :] = np.nan
        self.hot_vals[row, cols] = values
        self.last_seq[cols] = self.seq
        self.last_val[cols] = values
        self.last_t[cols] = t
        self.seq += 1
        self.hot_n = row + 1
        self.drop_expired()

    def drop_expired(self) -> None:
        """Drop the sealed blocks whose rows are all older than the retention."""
        floor = self.floor
        while self.blocks and self.blocks[0].seq0 + self.blocks[0].n <= floor:
            self.blocks.popleft()

    def _seal(self) -> None:
        n = self.hot_n
        ncols = self.ncols
        self.blocks.append(Block(self.seq - n, self.hot_ts[:n], self.hot_vals[:n, :ncols]))
        self.hot_n = 0
        self._compact()

    def _compact(self) -> None:
        """Merge the newest sealed blocks smaller than :func:`compact_rows_for` once they add up to it; with
        :attr:`defer_merges`, only note that a merge is due (the store merges outside its lock)."""
        if self.defer_merges:
            self.merge_due = True
            return
        tail = self.merge_tail()
        if tail is not None:
            self.replace_merged(tail, merge_blocks(tail, max(b.ncols for b in tail)))

    def merge_tail(self) -> list[Block] | None:
        """The two newest sealed blocks, oldest first, when both are smaller than :func:`compact_rows_for` and
        together no larger: each newly sealed block is merged at once into the one growing before it, so that at
        most one block short of that size is held, not up to ``target / block_rows - 1`` small ones (each small
        block pays the per-column cost of a whole one: 11 bytes for each of 13,000 series at 1,000 containers)."""
        if len(self.blocks) < 2:
            return None
        target = compact_rows_for(self.capacity, self.block_rows, self.max_block_rows)
        prev, new = self.blocks[-2], self.blocks[-1]
        if prev.n >= target or prev.n + new.n > target:
            return None
        return [prev, new]

    def replace_merged(self, tail: list[Block], merged: Block) -> bool:
        """Put ``merged`` in the place of the blocks ``tail`` (consecutive, by identity); False when they are no
        longer all there (expired, or the table restored meanwhile): nothing changes."""
        blocks = list(self.blocks)
        for i, b in enumerate(blocks):
            if b is tail[0]:
                if len(blocks) - i >= len(tail) and all(x is y for x, y in zip(blocks[i:], tail, strict=False)):
                    blocks[i:i + len(tail)] = [merged]
                    self.blocks = deque(blocks)
                    return True
                break
        return False

    def last_time(self) -> float | None:
        if self.seq == 0:
            return None
        if self.hot_n:
            return float(self.hot_ts[self.hot_n - 1])
        return self.blocks[-1].t_last

    def first_time(self) -> float | None:
        if self.seq == 0:
            return None
        ts, _ = self.rows(self.floor, self.floor + 1, np.zeros(0, dtype=np.int64))
        return float(ts[0])

    def _segments(self):
        """(seq0, n, block) oldest first for every stored run of rows; block None for the hot rows."""
        for b in self.blocks:
            yield b.seq0, b.n, b
        if self.hot_n:
            yield self.seq - self.hot_n, self.hot_n, None

    def seq_range_of_time(self, start: float, end: float) -> tuple[int, int]:
        """[lo, hi) seqs of kept rows with start ≤ t ≤ end (times are written in order). Only the two
        segments holding the ends are searched."""
        floor = self.floor
        segs = [(seq0, n, b) for seq0, n, b in self._segments() if seq0 + n > floor]
        if not segs or end < start:
            return 0, 0

        def times(seg):
            seq0, n, b = seg
            ts = b.ts if b is not None else self.hot_ts[:n]
            skip = max(0, floor - seq0)
            return seq0 + skip, ts[skip:]

        lo = None
        for seg in segs:  # the first row with t >= start
            last = seg[2].t_last if seg[2] is not None else self.hot_ts[seg[1] - 1]
            if last >= start:
                base, ts = times(seg)
                lo = base + int(np.searchsorted(ts, start, side="left"))
                break
        hi = None
        for seg in reversed(segs):  # one past the last row with t <= end
            base, ts = times(seg)
            if ts[0] <= end:
                hi = base + int(np.searchsorted(ts, end, side="right"))
                break
        if lo is None or hi is None or hi <= lo:
            return 0, 0
        return lo, hi

    def rows(self, lo: int, hi: int, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Times and values of ``cols`` for the rows with lo ≤ seq < hi (clipped to the kept rows), NaN where
        a series was not written."""
        cols = np.asarray(cols, dtype=np.int64)
        lo = max(lo, self.floor)
        hi = min(hi, self.seq)
        if hi <= lo:
            return np.empty(0), np.empty((0, len(cols)))
        k = len(cols)
        ts = np.empty(hi - lo)
        Vt = np.empty((k, hi - lo))  # column-major while filling: blocks decode one column per row
        off = 0
        for seq0, n, b in self._segments():
            a, z = max(lo, seq0) - seq0, min(hi, seq0 + n) - seq0
            if z <= a:
                continue
            m = z - a
            if b is None:
                ts[off:off + m] = self.hot_ts[a:z]
                if k:
                    Vt[:, off:off + m] = self.hot_vals[a:z][:, cols].T
            else:
                ts[off:off + m] = b.ts[a:z]
                if k and m == n:
                    b.decode_into(cols, Vt[:, off:off + m])
                elif k:
                    tmp = np.empty((k, n))
                    b.decode_into(cols, tmp)
                    Vt[:, off:off + m] = tmp[:, a:z]
            off += m
        V = Vt.T
        if k:
            since = self.since[cols]
            if (since > lo).any():  # a reused column: rows before its series began are not its
                seqs = np.arange(lo, hi)
                V[seqs[:, None] < since[None, :]] = np.nan
        return ts, V

    def read(self, start: float, end: float, cols) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.seq_range_of_time(start, end)
        return self.rows(lo, hi, cols)

    # -- checkpoint form (store/checkpoint.py) ------------------------------------------------------------
    STATE = ("last_seq", "last_val", "last_t", "since")  # per-column state a checkpoint keeps

    def saved_state(self) -> tuple[list[Block], np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """What a checkpoint saves, as it is in memory (copies of the uncompressed parts; blocks are immutable):
        the sealed blocks, the hot rows' times and values, and the per-column :attr:`STATE` arrays."""
        ncols = self.ncols
        state = {name: getattr(self, name)[:ncols].copy() for name in self.STATE}
        return list(self.blocks), self.hot_ts[: self.hot_n].copy(), self.hot_vals[: self.hot_n, :ncols].copy(), state

    def restore_rows(self, keys: list[tuple[str, Labels] | None], seq: int, blocks: list[Block],
                     hot_ts: np.ndarray, hot_vals: np.ndarray, state: Mapping[str, np.ndarray]) -> None:
        """Fill an empty table with a checkpoint's rows (the inverse of :meth:`saved_state`; the hot rows are
        sealed into a block, whatever block size this table now has). Raises ValueError on parts that do not fit
        together: shapes, blocks that do not tile the rows, times out of order."""
        ncols = len(keys)
        if self.seq or self.metrics:
            raise ValueError(f"table {self.name!r}: restore into a table that holds rows")
        if hot_ts.ndim != 1 or hot_vals.shape != (len(hot_ts), ncols):
            raise ValueError(f"table {self.name!r}: hot rows of shape {hot_vals.shape}, {ncols} keys")
        for name in self.STATE:
            if state[name].shape != (ncols,):
                raise ValueError(f"table {self.name!r}: {name} has shape {state[name].shape}, {ncols} keys")
        expect = seq - len(hot_ts)
        for b in reversed(blocks):  # blocks must tile the rows up to the hot ones, in time order
            if b.seq0 + b.n != expect or b.ncols > ncols:
                raise ValueError(f"table {self.name!r}: blocks do not line up (block at seq {b.seq0})")
            expect = b.seq0
        times = [b.t_last for b in blocks] + ([float(hot_ts[0])] if len(hot_ts) else [])
        if any(b < a for a, b in zip(times, times[1:], strict=False)) \
                or (len(hot_ts) > 1 and np.any(np.diff(hot_ts) < 0)):
            raise ValueError(f"table {self.name!r}: timestamps out of order")
        while self.hot_vals.shape[1] < ncols:
            self._grow()
        self.set_keys(keys)
        self.seq = seq
        self.first_seq = blocks[0].seq0 if blocks else seq - len(hot_ts)  # the rows before were not saved
        self.blocks.extend(blocks)
        if len(hot_ts):
            self.blocks.append(Block(seq - len(hot_ts), hot_ts, hot_vals))
        for name in self.STATE:
            getattr(self, name)[:ncols] = state[name]
        self.drop_expired()  # the retention may be shorter now than when the checkpoint was saved

    def free_column(self, col: int) -> None:
        """Give up column ``col`` (a restored series the store refused at max_series)."""
        if self.metrics[col] is not None:
            self.metrics[col] = self.label_sets[col] = None
            self.free.append(col)
            self.keys_version += 1
            self.generation += 1  # (a write plan naming the column resolves again)
            self.fast_col.clear()

    def truncated(self, limit: float) -> tuple[Table, int, float] | None:
        """This table rebuilt from its rows with t ≤ ``limit`` (times are in order, so they are a prefix), with
        the rows dropped and how far past ``limit`` the newest was; None when no row is after ``limit``."""
        last = self.last_time()
        if last is None or last <= limit:
            return None
        ncols = self.ncols
        lo = max(self.floor, self.blocks[0].seq0 if self.blocks else self.floor)
        ts, V = self.rows(lo, self.seq, np.arange(ncols))
        keep = int(np.searchsorted(ts, limit, side="right"))
        new = Table(self.name, self.capacity, columns=max(16, ncols))
        new.defer_merges = self.defer_merges
        new.metrics, new.label_sets, new.free = self.metrics, self.label_sets, self.free
        for r in range(keep):  # renumbered from 0: only what was written, so last_* come out right
            cols = np.flatnonzero(~np.isnan(V[r]))
            new.write_row(float(ts[r]), cols, V[r, cols])
        return new, len(ts) - keep, last - limit

    def nbytes(self) -> int:
        """Bytes the table's rows take (hot block, sealed blocks and per-column state)."""
        per_col = self.last_seq.nbytes + self.last_val.nbytes + self.last_t.nbytes + self.since.nbytes
        return self.hot_ts.nbytes + self.hot_vals.nbytes + per_col + sum(b.nbytes() for b in self.blocks)


@dataclass(frozen=True)
class RowHandle:
    table: str
    cols: np.ndarray
    generation: int
    keys: list
    interval_seconds: float


class NewRows(NamedTuple):
    """Rows of one table written after a cursor position (:meth:`Store.rows_since`)."""

    table: str
    start: int  # the cursor position asked for
    first: int  # first row still held (> start when the ring overwrote some)
    end: int  # Table.seq: the cursor position to continue from
    keys: list[tuple[str, Labels] | None]  # per column, None for a free column
    ts: np.ndarray
    values: np.ndarray  # [rows, columns]


BY_INDEX_KEEP = 64  # Store.by_index: derived values kept
_T = TypeVar("_T")
_REFUSED_KEEP = 65536  # refused series keys remembered (so each counts once); beyond, each refusal counts
_PAIRS_KEEP = 65536  # interned label pairs kept at least (see Store._labels_key)


class Sample(NamedTuple):
    """One value of one series. A NamedTuple: collectors create many of these per run."""

    metric: str
    labels: Mapping[str, str]
    value: float


class Columns(NamedTuple):
    """One row given as vectors (the write path of a high-cardinality collector): ``keys[i]`` names the series
    of ``values[i]``; NaN means the series was not read in this row. A collector hands the *same* ``keys``
    list object for as long as its series stay the same (and a new list when they change), so that the store
    resolves keys to columns only on change (:meth:`Store.append_columns`); its key tuples may be shared
    between successive lists, so a change costs in proportion to the series added."""

    keys: Sequence[tuple[str, Mapping[str, str]]]
    values: np.ndarray

    def samples(self) -> list[Sample]:
        """The same row as :class:`Sample` s (NaN left out), in key order."""
        return [Sample(m, lab, float(v)) for (m, lab), v in zip(self.keys, self.values.tolist(), strict=True)
                if v == v]


@dataclass
class _ColumnPlan:
    """Per table: the last :class:`Columns` keys list seen and its columns (-1: not resolved yet: a series
    not written so far, or refused at max_series) under the table's column generation."""

    table: Table
    keys: Sequence
    cols: np.ndarray
    generation: int

    def valid_for(self, tab: Table) -> bool:
        return self.table is tab and self.generation == tab.generation


class Store:
    def __init__(self, retention_seconds: float = 3600.0, max_series: int = 200_000):
        self.retention_seconds = retention_seconds
        self.max_series = max_series
        self.tables: dict[str, Table] = {}
        # metric -> table -> label set -> column: the one map from a series to its column (a write resolving a new
        # key asks it too), holding column numbers, not an object per series; a SeriesRef is made when a reader
        # asks (select, series_by_metric): at 20 k series the refs held took ~1.5 MB.
        self._index: dict[str, dict[str, dict[Labels, int]]] = {}
        # per metric: label pair -> series keys, built on first select and dropped whenever the metric
        # gains or loses a series
        self._inverted: dict[str, dict[tuple[str, str], set[Labels]]] = {}
        self.dropped_samples = 0
        # New series refused at max_series, each counted once (up to _REFUSED_KEEP remembered keys).
        self.dropped_series = 0
        self._refused: set[tuple[str, Labels]] = set()
        # Rows refused because their time was before the table's newest row (the wall clock stepped back):
        # writing them would break time order, and nudging them just past the newest row made rates spike.
        self.rows_out_of_order = 0
        self._series = 0
        self._lock = threading.RLock()
        # Label pairs shared by every series key that holds them: ("namespace", "default") once, not once per
        # series (at 20 k series the index took ~1.7 KB a series, most of it copies of the same pairs); and whole
        # label sets shared by every series that has one (a container's 13 metrics, their blocks' keys and index
        # entries hold one tuple, not 13).
        self._pairs: dict[tuple[str, str], tuple[str, str]] = {}
        self._label_sets: dict[Labels, Labels] = {}
        self._plans: dict[str, _ColumnPlan] = {}  # per table, for append_columns
        self.index_version = 0  # bumped whenever a series enters or leaves the index (readers cache by it)
        self._by_index: dict[Hashable, tuple[int, Any]] = {}  # by_index(): key -> (index_version, value)
        # Called (outside the lock) after a merge replaced sealed blocks: the agent returns the merge's freed
        # temporaries and blocks to the OS here (heap.release_free_heap), as after a checkpoint.
        self.after_merge: Callable[[], object] | None = None

    def _labels_key(self, labels: Mapping[str, str]) -> Labels:
        """:func:`labels_key` interned: the store's one tuple for this label set, made of its shared pairs (which a
        :class:`LabelSet` then holds too)."""
        if max(len(self._pairs), len(self._label_sets)) > max(_PAIRS_KEEP, 4 * self._series):  # churn: start again
            self._pairs.clear()
            self._label_sets.clear()
        if type(labels) is LabelSet:
            lk = self._label_sets.get(labels.pairs) or self._intern(labels.pairs)
            labels.share(lk)
            return lk
        pairs = self._pairs
        lk = tuple(sorted(pairs.setdefault(p, p) for p in ((k, str(v)) for k, v in labels.items())))
        return self._intern_set(lk)

    def _intern(self, lk: Labels) -> Labels:
        pairs = self._pairs
        return self._intern_set(tuple(pairs.setdefault(p, p) for p in lk))

    def _intern_set(self, lk: Labels) -> Labels:
        return self._label_sets.setdefault(lk, lk)

    # -- writing -----------------------------------------------------------------------------------
    def table(self, name: str, interval_seconds: float) -> Table:
        with self._lock:
            t = self.tables.get(name)
            if t is None:
                t = self.tables[name] = Table(name, self.capacity_for(interval_seconds))
                t.defer_merges = True
            return t

    def capacity_for(self, interval_seconds: float) -> int:
        """Rows a table written every ``interval_seconds`` keeps to cover the retention."""
        return max(2, int(math.ceil(self.retention_seconds / max(interval_seconds, 1e-3))) + 1)

    def resize(self, name: str, interval_seconds: float) -> bool:
        """Re-size a table for a new write interval, so that it still keeps the retention; False if absent."""
        with self._lock:
            t = self.tables.get(name)
            if t is None:
                return False
            cap = self.capacity_for(interval_seconds)
            if cap != t.capacity:
                t.resize(cap)
            return True

    def append(self, table: str, t: float, samples: Iterable[Sample], interval_seconds: float = 1.0) -> None:
        """Write one row: every sample of ``samples`` at time ``t`` into ``table``."""
        with self._lock:
            tab = self.table(table, interval_seconds)
            row_t = self._row_time(tab, t)
            if row_t is None:
                return
            t = row_t
            cols: list[int] = []
            vals: list[float] = []
            fast = tab.fast_col  # (metric, labels as given) -> column: skips sorting for known series
            for s in samples:
                fk = (s.metric, tuple(s.labels.items()))
                col = fast.get(fk)
                if col is None:
                    col = self._column_of(tab, s.metric, s.labels)
                    if col is None:
                        self.dropped_samples += 1
                        continue
                    pairs = self._pairs  # the fast key keeps interned pairs too
                    fast[(s.metric, tuple(pairs.get(p, p) for p in fk[1]))] = col
                cols.append(col)
                vals.append(s.value)
            tab.write_row(t, np.asarray(cols, dtype=np.int64), np.asarray(vals, dtype=np.float64))
            if tab.seq % max(1, tab.capacity // 4) == 0:
                self._reclaim(tab)
        self._merge_sealed(tab)

    def _row_time(self, tab: Table, t: float) -> float | None:
        """The time a new row of ``tab`` is written at: ``t``, nudged past the newest row when it is the same
        instant (order kept); None, counted, for a row older than the newest."""
        last = tab.last_time()
        if last is None or t > last:
            return t
        if t < last:
            self.rows_out_of_order += 1
            return None
        return float(np.nextafter(last, np.inf))

    def _column_of(self, tab: Table, metric: str, labels: Mapping[str, str]) -> int | None:
        """The column of a series in ``tab``, made if new; None when refused at max_series."""
        lk = self._labels_key(labels)
        col = self._index.get(metric, {}).get(tab.name, {}).get(lk)
        if col is None:
            col = self._new_series(tab, metric, lk)
        return col

    def append_columns(self, table: str, t: float, row: Columns, interval_seconds: float = 1.0) -> None:
        """Write one row given as :class:`Columns` (the same as :meth:`append` of ``row.samples()``). Keys are
        resolved to columns when ``row.keys`` is a new list, from the previous list's where the key tuples are
        the same objects, and a series only once it has a value: a cycle without change is a few vector
        operations, whatever the number of series."""
        with self._lock:
            tab = self.table(table, interval_seconds)
            row_t = self._row_time(tab, t)
            if row_t is None:
                return
            t = row_t
            values = np.asarray(row.values, dtype=np.float64)
            plan = self._plans.get(table)
            if plan is None or plan.keys is not row.keys or not plan.valid_for(tab):
                prev: dict[int, int] = {}
                if plan is not None and plan.valid_for(tab):
                    # (ids of the previous list's tuples are safe here: the plan still holds them)
                    prev = {id(k): int(c) for k, c in zip(plan.keys, plan.cols.tolist(), strict=True) if c >= 0}
                cols = np.fromiter((prev.get(id(k), -1) for k in row.keys), dtype=np.int64, count=len(row.keys))
                plan = self._plans[table] = _ColumnPlan(tab, row.keys, cols, tab.generation)
            cols = plan.cols
            has = ~np.isnan(values)
            todo = np.flatnonzero(has & (cols < 0))
            for i in todo.tolist():
                metric, labels = row.keys[i]
                col = self._column_of(tab, metric, labels)
                if col is None:
                    self.dropped_samples += 1
                else:
                    cols[i] = col
            ok = has & (cols >= 0)
            tab.write_row(t, cols[ok], values[ok])
            if tab.seq % max(1, tab.capacity // 4) == 0:
                self._reclaim(tab)
        self._merge_sealed(tab)

    def prepare(self, table: str, keys: list[tuple[str, Mapping[str, str]]],
                interval_seconds: float = 1.0) -> RowHandle:
        """Resolve a fixed list of series to columns once, for :meth:`write` (the vector fast path)."""
        with self._lock:
            tab = self.table(table, interval_seconds)
            cols = []
            for metric, labels in keys:
                col = self._column_of(tab, metric, labels)
                cols.append(-1 if col is None else col)
            return RowHandle(table, np.asarray(cols, dtype=np.int64), tab.generation, list(keys), interval_seconds)

    def write(self, handle: RowHandle, t: float, values: np.ndarray) -> RowHandle:
        """Write one row for a prepared handle; returns the handle to use next time."""
        with self._lock:
            tab = self.tables.get(handle.table)
            if tab is None or tab.generation != handle.generation:
                handle = self.prepare(handle.table, handle.keys, handle.interval_seconds)
                tab = self.tables[handle.table]
            last = tab.last_time()
            if last is not None and t <= last:
                if t < last:
                    self.rows_out_of_order += 1
                    return handle
                t = float(np.nextafter(last, np.inf))
            values = np.asarray(values, dtype=np.float64)
            ok = handle.cols >= 0
            if not ok.all():
                self.dropped_samples += int((~ok).sum())
            tab.write_row(t, handle.cols[ok], values[ok])
            if tab.seq % max(1, tab.capacity // 4) == 0:
                self._reclaim(tab)
        self._merge_sealed(tab)
        return handle

    def _merge_sealed(self, tab: Table) -> None:
        """Merge the small sealed blocks a write left due (:meth:`Table.merge_tail`), outside the lock: at 1,000
        containers a merge takes tens of ms, which a scrape or another collector's write would otherwise wait for.
        Blocks never change, so they are read without the lock; the merged one replaces them under it, unless they
        went meanwhile (then the next seal tries again)."""
        if not tab.merge_due:  # (read without the lock: a merge noted meanwhile waits for the next write)
            return
        with self._lock:
            tail = tab.merge_tail() if tab.merge_due else None
            tab.merge_due = False
        if tail is not None:
            merged = merge_blocks(tail, max(b.ncols for b in tail))
            with self._lock:
                tab.replace_merged(tail, merged)
            del tail, merged
            if self.after_merge is not None:
                self.after_merge()

    def _new_series(self, tab: Table, metric: str, lk: Labels) -> int | None:
        """A column of ``tab`` for a series not stored yet, indexed; None when the store is at max_series."""
        if self._series >= self.max_series:
            self._refuse((metric, lk))
            return None
        col = tab.add_column(metric, lk)
        self._index_series(metric, lk, tab.name, col)
        return col

    def _index_series(self, metric: str, lk: Labels, table: str, col: int) -> None:
        """The one place a series enters the index (append, prepare, checkpoint restore). A series is in one
        column of one table: one a checkpoint names twice is the one indexed last, and its other column is freed
        (the index is what finds a series' column, so a column it no longer names would never be written again
        nor read; freed, a write to the other table takes a column anew instead of another each time)."""
        by_table = self._index.setdefault(metric, {})
        for other, cols in [(t, cols) for t, cols in by_table.items() if lk in cols and (t, cols[lk]) != (table, col)]:
            old = cols.pop(lk)
            self._series -= 1
            tab = self.tables.get(other)
            if tab is not None and old < tab.ncols and tab.key(old) == (metric, lk):
                tab.free_column(old)
            if not cols:
                del by_table[other]
        cols = by_table.setdefault(table, {})
        if cols.get(lk) == col:
            return
        cols[lk] = col
        self._inverted.pop(metric, None)
        self._series += 1
        self.index_version += 1

    # -- restoring (store/checkpoint.py) -------------------------------------------------------------
    def replace_table(self, name: str, capacity: int, columns: int) -> Table:
        """A new empty table under ``name`` (dropping one of that name), for a checkpoint to fill."""
        with self._lock:
            tab = self.tables[name] = Table(name, capacity, columns=columns)
            tab.defer_merges = True
            self._plans.pop(name, None)
            return tab

    def adopt_series(self, tab: Table, key: tuple[str, Labels], col: int) -> bool:
        """Index a series a checkpoint placed in column ``col`` of ``tab``; False at max_series (not indexed)."""
        with self._lock:
            if self._series >= self.max_series:
                return False
            self._index_series(key[0], key[1], tab.name, col)
            return True

    def restore_table(self, name: str, capacity: int, keys: list[tuple[str, Labels] | None], seq: int,
                      blocks: list[Block], hot_ts: np.ndarray, hot_vals: np.ndarray,
                      state: Mapping[str, np.ndarray]) -> int:
        """Replace table ``name`` by a checkpoint's (:meth:`Table.restore_rows`) and index its series; those past
        max_series are not indexed and their columns freed. Returns the series indexed."""
        with self._lock:
            keys = [None if k is None else (k[0], self._intern(k[1])) for k in keys]
            tab = self.replace_table(name, capacity, columns=max(16, len(keys)))
            tab.restore_rows(keys, seq, blocks, hot_ts, hot_vals, state)
            n = 0
            for col, key in enumerate(keys):
                if key is not None and not self.adopt_series(tab, key, col):
                    tab.free_column(col)
                elif key is not None:
                    n += 1
            return n

    def drop_after(self, limit: float) -> tuple[int, float]:
        """Drop every row with a time after ``limit`` (the wall clock was set back since they were written:
        appending after them would be refused as out of order). Returns (rows dropped, how far past ``limit``
        the newest was)."""
        dropped, ahead = 0, 0.0
        with self._lock:
            for name, tab in list(self.tables.items()):
                cut = tab.truncated(limit)
                if cut is not None:
                    self.tables[name], n, past = cut
                    dropped, ahead = dropped + n, max(ahead, past)
        return dropped, ahead

    def clear(self) -> None:
        """Forget every table and series (undoes a partial checkpoint load)."""
        with self._lock:
            self.tables.clear()
            self._index.clear()
            self._inverted.clear()
            self._plans.clear()
            self.index_version += 1
            self._pairs.clear()
            self._label_sets.clear()
            self._series = 0

    def _refuse(self, key: tuple[str, Labels]) -> None:
        if key not in self._refused:
            self.dropped_series += 1
            if len(self._refused) < _REFUSED_KEEP:
                self._refused.add(key)

    def _reclaim(self, tab: Table) -> None:
        for metric, lk in tab.reclaim():
            self.index_version += 1
            series = self._index.get(metric, {})
            self._inverted.pop(metric, None)
            cols = series.get(tab.name, {})
            if lk in cols:
                del cols[lk]
                self._series -= 1
                if not cols:
                    del series[tab.name]
                    if not series:
                        del self._index[metric]

    # -- reading -----------------------------------------------------------------------------------
    @property
    def series_count(self) -> int:
        return self._series

    def metrics(self) -> list[str]:
        with self._lock:
            return sorted(self._index)

    def has_metric(self, metric: str) -> bool:
        with self._lock:
            return metric in self._index

    def count(self, metric: str) -> int:
        """Series stored of ``metric``."""
        with self._lock:
            return sum(len(cols) for cols in self._index.get(metric, {}).values())

    @staticmethod
    def _refs(metric: str, by_table: Mapping[str, Mapping[Labels, int]]) -> list[SeriesRef]:
        return [SeriesRef(metric, lk, table, col) for table, cols in by_table.items() for lk, col in cols.items()]

    def series_by_metric(self) -> dict[str, list[SeriesRef]]:
        """Every stored series, per metric in first-written order: a snapshot, safe to use without the lock."""
        with self._lock:
            return {m: self._refs(m, series) for m, series in self._index.items()}

    def versioned_columns(self) -> tuple[int, dict[str, list[tuple[str, list[Labels], np.ndarray]]]]:
        """Every stored series as :meth:`series_by_metric` lists them, without a SeriesRef each: per metric, per
        table its label sets and their columns, with the :attr:`index_version` they are of (a snapshot, safe to use
        without the lock)."""
        with self._lock:
            return self.index_version, {
                m: [(table, list(cols), np.fromiter(cols.values(), dtype=np.int64, count=len(cols)))
                    for table, cols in series.items()]
                for m, series in self._index.items()}

    def by_index(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()``, kept until a series enters or leaves the index: for readers that derive something from
        the set of series alone (which series a query reads, grouped by a label), every round, while that set
        rarely changes. At most ``BY_INDEX_KEEP`` keys are kept (the oldest go first)."""
        with self._lock:
            version = self.index_version
            hit = self._by_index.get(key)
            if hit is not None and hit[0] == version:
                return hit[1]
        value = compute()
        with self._lock:  # with the version it was computed from: a change meanwhile makes the next call compute
            self._by_index.pop(key, None)
            self._by_index[key] = (version, value)
            while len(self._by_index) > BY_INDEX_KEEP:
                del self._by_index[next(iter(self._by_index))]
        return value

    def row_counts(self) -> dict[str, int]:
        """Rows ever written per table (``Table.seq``): the cursor :meth:`rows_since` continues from."""
        with self._lock:
            return {name: tab.seq for name, tab in self.tables.items()}

    def rows_since(self, seen: Mapping[str, int]) -> list[NewRows]:
        """Per table with rows written after ``seen[table]`` (0 when absent): the ones still held, every column,
        NaN where a series was not written. ``first > seen`` means rows were overwritten before being read."""
        out = []
        with self._lock:
            for name, tab in self.tables.items():
                start = seen.get(name, 0)
                if tab.seq <= start:
                    continue
                first = max(start, tab.seq - tab.count)
                keys = list(tab.keys)
                ts, values = tab.rows(first, tab.seq, np.arange(len(keys)))
                out.append(NewRows(name, start, first, tab.seq, keys, ts, values))
        return out

    def select(self, metric: str, matchers: Iterable[LabelMatcher] = ()) -> list[SeriesRef]:
        """Series of ``metric`` matching all ``matchers``, per table in the order they were first written. Equality
        matchers are answered from an inverted index; the others are tried on each remaining series."""
        matchers = list(matchers)
        eq = [m for m in matchers if m.op == "=" and m.value != ""]  # ="" also matches a missing label
        rest = [m for m in matchers if not (m.op == "=" and m.value != "")]
        with self._lock:
            series = self._index.get(metric, {})
            if eq:
                inv = self._inverted.get(metric)
                if inv is None:
                    inv = self._inverted[metric] = {}
                    for cols in series.values():
                        for lk in cols:
                            for pair in lk:
                                inv.setdefault(pair, set()).add(lk)
                cand = set.intersection(*(inv.get((m.label, m.value), set()) for m in eq))
                refs = [SeriesRef(metric, lk, table, col) for table, cols in series.items()
                        for lk, col in cols.items() if lk in cand] if cand else []
            else:
                refs = self._refs(metric, series)
        if not rest:
            return refs
        return [r for r in refs if all(m.matches(r.label_dict) for m in rest)]

    def raw(self, ref: SeriesRef, start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """Samples of one series with start ≤ t ≤ end, NaN (not written) removed."""
        with self._lock:
            ts, V = self.tables[ref.table].read(start, end, [ref.col])
        vs = V[:, 0]
        ok = ~np.isnan(vs)
        return ts[ok], vs[ok]

    def raw_matrix(self, table: str, cols: list[int], start: float, end: float) -> tuple[np.ndarray, np.ndarray]:
        """Rows with start ≤ t ≤ end of several columns of one table: (ts, values[rows, cols]), NaN kept."""
        with self._lock:
            return self.tables[table].read(start, end, cols)

    def latest_vectors(self, max_age_rows: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per table: (live mask, latest value) for every column, computed as vectors."""
        out = {}
        with self._lock:
            for name, tab in self.tables.items():
                n = tab.ncols
                if tab.count == 0 or n == 0:
                    continue
                last = tab.last_seq[:n]
                age = tab.seq - 1 - last
                live = (last >= 0) & (age <= max_age_rows) & (age < tab.count)
                out[name] = (live, tab.last_val[:n].copy())
        return out

    def latest(self, metric: str | None = None, max_age_rows: int = 0) -> list[tuple[SeriesRef, float, float]]:
        """(ref, time, value) for every live series: written in its table's newest row."""
        out = []
        with self._lock:
            metrics = [metric] if metric else list(self._index)
            for m in metrics:
                for table, cols in self._index.get(m, {}).items():
                    tab = self.tables[table]
                    oldest = tab.seq - 1 - max_age_rows  # (a table with no rows has none live)
                    out += [(SeriesRef(m, lk, table, col), float(tab.last_t[col]), float(tab.last_val[col]))
                            for lk, col in cols.items() if tab.seq and tab.last_seq[col] >= oldest]
        return out

    def span(self) -> tuple[float, float] | None:
        with self._lock:
            held = [tab for tab in self.tables.values() if tab.count]
            firsts = [t for t in (tab.first_time() for tab in held) if t is not None]
            lasts = [t for t in (tab.last_time() for tab in held) if t is not None]
            return (min(firsts), max(lasts)) if firsts and lasts else None

    # lock for checkpointing
    @property
    def lock(self) -> threading.RLock:
        return self._lock

