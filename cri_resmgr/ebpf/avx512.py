"""Load the AVX-512 counting program and read its maps.

Two loaders produce the same :class:`Snapshot`:

- :class:`LibbpfSource` opens the CO-RE object ``avx512.bpf.o`` (compiled into the wheel, or by ``make bpf`` in
  a checkout; no clang at run time) with the system libbpf through :mod:`cri_resmgr.ebpf.libbpf`;
- :class:`BccSource` compiles ``avx512_bcc.c`` with bcc (Debian ``python3-bpfcc``) for kernels without
  BTF that have kernel headers. bcc keeps LLVM in the process (~140 MB), which is why it is the fallback.

Map layouts are in ``avx512.h``; the ``struct`` formats below mirror them and
``tests/test_avx512_loader.py`` checks them against the object's BTF-described sizes.
"""

from __future__ import annotations

import importlib
import importlib.util
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .libbpf import BpfMap, BpfObject, Libbpf, LibbpfError, MapInfo

HERE = Path(__file__).resolve().parent
DEFAULT_OBJECT = HERE / "avx512.bpf.o"
BCC_SOURCE = HERE / "avx512_bcc.c"
# Debian installs python3-bpfcc for the system interpreter only; an agent in a venv or another build of
# the same Python version can still import the pure-Python ``bcc`` package from there.
BCC_PYTHON_DIRS = (Path("/usr/lib/python3/dist-packages"),)

COUNTS_MAP = "counts"
CPU_TOTALS_MAP = "cpu_totals"
PROGRAMS = {"avx512_switch": "tp_btf/sched_switch", "avx512_fpu": "tp_btf/x86_fpu_regs_deactivated"}

KEY = struct.Struct("=QII")  # struct avx512_key
COUNTS = struct.Struct("=QQQ")  # struct avx512_counts
CPU_TOTALS = struct.Struct("=QQQ")  # struct avx512_cpu_totals
CONFIG = struct.Struct("=II")  # struct avx512_config
KEY_DTYPE = np.dtype([("cgroup_id", "=u8"), ("tgid", "=u4"), ("pad", "=u4")])  # KEY, for batch reads


class LoaderError(Exception):
    """The program could not be loaded or read; the message is the reason shown for the collector."""


@dataclass(frozen=True, order=True)
class CounterKey:
    cgroup_id: int
    tgid: int = 0  # 0 unless counting per process (v1-only hosts), or the idle task


@dataclass(frozen=True)
class Counts:
    """One key's counters summed over CPUs (``last_avx512_ns``: the latest over CPUs)."""

    avx512_switches: int = 0
    switches: int = 0
    last_avx512_ns: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.avx512_switches + other.avx512_switches, self.switches + other.switches,
                      max(self.last_avx512_ns, other.last_avx512_ns))


@dataclass(frozen=True)
class CpuTotals:
    avx512_switches: int = 0
    switches: int = 0
    failed_inserts: int = 0


@dataclass(frozen=True)
class Snapshot:
    counts: dict[CounterKey, Counts]
    cpus: list[CpuTotals]  # index = CPU number (all possible CPUs)
    capacity: int

    @property
    def failed_inserts(self) -> int:
        return sum(c.failed_inserts for c in self.cpus)


def sum_counts(slots: Iterable[tuple[int, int, int]]) -> Counts:
    a = s = last = 0
    for avx, sw, ns in slots:
        a += avx
        s += sw
        last = max(last, ns)
    return Counts(a, s, last)


def decode_key(raw: bytes) -> CounterKey:
    cg, tgid, _ = KEY.unpack(raw[:KEY.size])
    return CounterKey(cg, tgid)


def encode_key(k: CounterKey) -> bytes:
    return KEY.pack(k.cgroup_id, k.tgid, 0)


@dataclass
class Avx512Source:
    """What the collector needs from a loader."""

    loader: str
    key_by_tgid: bool
    capacity: int
    attached: list[str] = field(default_factory=list)

    def read(self) -> Snapshot:
        raise NotImplementedError

    def retire(self, keys: Iterable[CounterKey]) -> dict[CounterKey, Counts]:
        """Delete keys whose cgroup or process has gone, returning their final counts."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class LibbpfSource(Avx512Source):
    def __init__(self, object_path: Path, map_entries: int, key_by_tgid: bool, lb: Libbpf | None = None):
        super().__init__("libbpf", key_by_tgid, map_entries)
        try:
            self.obj = BpfObject(object_path, lb)
        except LibbpfError as e:
            raise LoaderError(str(e)) from None
        try:
            rodata = self.obj.rodata_map_name()
            if rodata is None:
                raise LoaderError(f"{object_path}: no .rodata map (built from another source?)")
            self.obj.set_initial_value(rodata, CONFIG.pack(1 if key_by_tgid else 0, 0))
            self.obj.set_max_entries(COUNTS_MAP, map_entries)
            self.obj.load()
            self.obj.attach_all()
            self.counts: BpfMap = self.obj.map(COUNTS_MAP)
            self.totals: BpfMap = self.obj.map(CPU_TOTALS_MAP)
        except LibbpfError as e:
            self.obj.close()
            raise LoaderError(str(e)) from None
        except LoaderError:
            self.obj.close()
            raise
        self.attached = [p.section for p in self.obj.programs()]
        self.batch = True  # read the counts map with BPF_MAP_LOOKUP_BATCH until the kernel says it cannot

    @staticmethod
    def _decode(m: BpfMap, value: bytes) -> Counts:
        # ncpus slots of 3 u64 each (slot size 24 is already 8-aligned); numpy because big nodes have
        # hundreds of CPUs per key
        a = np.frombuffer(value, dtype=np.uint64).reshape(m.ncpus, m.slot_size // 8)
        return Counts(int(a[:, 0].sum()), int(a[:, 1].sum()), int(a[:, 2].max()))

    def read_counts_batch(self) -> dict[CounterKey, Counts] | None:
        """The counts map in BPF_MAP_LOOKUP_BATCH calls, summed over CPUs with numpy: a few syscalls a run
        instead of two per key (a thousand containers' keys cost ~2,000 ctypes calls). None where the kernel
        has no batch lookup."""
        got = self.counts.lookup_batch()
        if got is None:
            return None
        raw_keys, raw_values = got
        m = self.counts
        k = raw_keys.view(KEY_DTYPE).reshape(-1)
        v = raw_values.view(np.uint64).reshape(len(raw_values), m.ncpus, m.slot_size // 8)
        return {CounterKey(cg, tgid): Counts(a, s, last) for cg, tgid, a, s, last in zip(
            k["cgroup_id"].tolist(), k["tgid"].tolist(), v[:, :, 0].sum(axis=1).tolist(),
            v[:, :, 1].sum(axis=1).tolist(), v[:, :, 2].max(axis=1, initial=0).tolist(), strict=True)}

    def read_counts_by_key(self) -> dict[CounterKey, Counts]:
        """The counts map walked key by key (get_next_key, lookup): kernels without batch lookup."""
        out: dict[CounterKey, Counts] = {}
        for raw in list(self.counts.keys()):
            v = self.counts.lookup(raw)
            if v is not None:  # deleted since get_next_key
                out[decode_key(raw)] = self._decode(self.counts, v)
        return out

    def read(self) -> Snapshot:
        try:
            out = self.read_counts_batch() if self.batch else None
            if out is None:
                self.batch = False  # not on this kernel: the key walk from now on
                out = self.read_counts_by_key()
            tv = self.totals.lookup(b"\0\0\0\0")
            cpus = [CpuTotals(*CPU_TOTALS.unpack(s)) for s in self.totals.slots(tv)] if tv else []
        except LibbpfError as e:
            raise LoaderError(str(e)) from None
        return Snapshot(out, cpus, self.counts.info.max_entries)

    def retire(self, keys: Iterable[CounterKey]) -> dict[CounterKey, Counts]:
        out = {}
        try:
            for k in keys:
                v = self.counts.lookup_and_delete(encode_key(k))
                if v is not None:
                    out[k] = self._decode(self.counts, v)
        except LibbpfError as e:
            raise LoaderError(str(e)) from None
        return out

    def close(self) -> None:
        self.obj.close()


def find_bcc() -> Path | None:
    """Where the ``bcc`` Python package is, without importing it (importing loads LLVM)."""
    spec = importlib.util.find_spec("bcc")
    if spec is not None and spec.origin:
        return Path(spec.origin).parent
    for d in BCC_PYTHON_DIRS:
        if (d / "bcc" / "__init__.py").exists():
            return d / "bcc"
    return None


def import_bcc():
    pkg = find_bcc()
    if pkg is None:
        raise LoaderError("bcc is not installed (Debian package python3-bpfcc)")
    if str(pkg.parent) not in sys.path and importlib.util.find_spec("bcc") is None:
        sys.path.append(str(pkg.parent))
    try:
        return importlib.import_module("bcc")
    except Exception as e:  # libbcc.so missing or of another version: report, do not crash
        raise LoaderError(f"cannot import bcc from {pkg}: {type(e).__name__}: {e}") from e


class BccSource(Avx512Source):
    def __init__(self, map_entries: int, key_by_tgid: bool, bcc_module=None):
        super().__init__("bcc", key_by_tgid, map_entries)
        bcc = bcc_module or import_bcc()
        cflags = [f"-I{HERE}", f"-DAVX512_MAP_ENTRIES={map_entries}", f"-DAVX512_KEY_BY_TGID={int(key_by_tgid)}"]
        try:
            self.bpf = bcc.BPF(text=BCC_SOURCE.read_bytes(), cflags=cflags)
        except Exception as e:  # bcc raises plain Exception for compile and header failures
            raise LoaderError(f"bcc could not compile {BCC_SOURCE.name}: {e}") from e
        self.attached = ["tracepoint/sched/sched_switch", "tracepoint/x86_fpu/x86_fpu_regs_deactivated"]
        self.counts = self.bpf["counts"]
        self.totals = self.bpf["cpu_totals"]

    @staticmethod
    def _decode(values) -> Counts:
        return sum_counts((v.avx512_switches, v.switches, v.last_avx512_ns) for v in values)

    def read(self) -> Snapshot:
        out = {CounterKey(k.cgroup_id, k.tgid): self._decode(v) for k, v in self.counts.items()}
        per_cpu = self.totals[self.totals.Key(0)]
        cpus = [CpuTotals(v.avx512_switches, v.switches, v.failed_inserts) for v in per_cpu]
        return Snapshot(out, cpus, self.capacity)

    def retire(self, keys: Iterable[CounterKey]) -> dict[CounterKey, Counts]:
        out = {}
        for k in keys:
            key = self.counts.Key(k.cgroup_id, k.tgid, 0)
            try:
                v = self.counts[key]
                del self.counts[key]
            except KeyError:
                continue
            out[k] = self._decode(v)
        return out

    def close(self) -> None:
        self.bpf.cleanup()


@dataclass(frozen=True)
class ObjectDescription:
    maps: dict[str, MapInfo]
    programs: dict[str, str]  # name -> section
    rodata_size: int


def describe_object(path: Path, lb: Libbpf | None = None) -> ObjectDescription:
    """Open (not load) the object and describe its maps and programs; needs no privileges."""
    with BpfObject(path, lb) as obj:
        rodata = obj.rodata_map_name()
        return ObjectDescription(obj.maps(), {p.name: p.section for p in obj.programs()},
                                 len(obj.initial_value(rodata)) if rodata else 0)
