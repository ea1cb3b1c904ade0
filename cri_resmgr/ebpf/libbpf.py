"""A thin ctypes binding over the system ``libbpf.so.1`` (Debian ``libbpf1``): open, configure, load and
attach a BPF object file, and read its maps by file descriptor.

Only the libbpf 1.x API is used (tools/lib/bpf/libbpf.h and bpf.h in the kernel tree; libbpf 1.0 made
"strict mode" the default): functions returning a pointer return NULL and set ``errno`` on error,
functions returning ``int`` return ``-errno``. Nothing here needs clang; opening an object needs no
privileges, loading and attaching need CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN).
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SONAME = "libbpf.so.1"

# enum bpf_map_type (include/uapi/linux/bpf.h); only the ones this project uses are named.
BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_ARRAY = 2
BPF_MAP_TYPE_PERCPU_HASH = 5
BPF_MAP_TYPE_PERCPU_ARRAY = 6
MAP_TYPE_NAMES = {BPF_MAP_TYPE_HASH: "hash", BPF_MAP_TYPE_ARRAY: "array",
                  BPF_MAP_TYPE_PERCPU_HASH: "percpu_hash", BPF_MAP_TYPE_PERCPU_ARRAY: "percpu_array"}

# Errors a kernel gives for a bpf(2) command or map operation it does not have: EINVAL for a command number it does
# not know (BPF_MAP_LOOKUP_BATCH is 5.6+), ENOTSUPP (524, include/linux/errno.h; not in userspace errno.h) for a map
# type without the operation (kernel/bpf/syscall.c, BPF_DO_BATCH).
ENOTSUPP = 524
UNSUPPORTED = (errno_mod.EINVAL, ENOTSUPP)

# enum libbpf_print_level (libbpf.h)
LIBBPF_WARN, LIBBPF_INFO, LIBBPF_DEBUG = 0, 1, 2


class LibbpfError(Exception):
    """A libbpf call failed; ``errno`` is the positive error number, ``log`` what libbpf printed meanwhile."""

    def __init__(self, what: str, err: int, log: str = ""):
        self.errno = err
        self.log = log
        msg = f"{what}: {os.strerror(err) if err else 'failed'}"
        if log:
            msg += f"; libbpf: {log}"
        super().__init__(msg)


_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class _Log:
    """libbpf's print callback is process-global: one collector of messages, guarded by a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lines: list[str] = []
        self.capture = False
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
        self.libc.vsnprintf.restype = ctypes.c_int

        # On x86-64 a va_list argument is passed as a pointer to the va_list structure, so it can be handed
        # on to vsnprintf as an opaque pointer (System V AMD64 ABI, 3.5.7).
        def _print(level: int, fmt: bytes, args: int) -> int:
            if level > LIBBPF_INFO or not self.capture:
                return 0
            buf = ctypes.create_string_buffer(4096)
            self.libc.vsnprintf(buf, len(buf), fmt, args)
            text = buf.value.decode(errors="replace").rstrip()
            if text:
                self.lines.append(text)
            return 0

        self.callback = _PRINT_FN(_print)  # kept referenced: libbpf holds the raw pointer

    def take(self, last: int = 12) -> str:
        keep = [ln for ln in self.lines if ln.strip()]
        self.lines = []
        return " | ".join(keep[-last:])


class Libbpf:
    """The loaded shared library with argument and return types declared."""

    def __init__(self, soname: str = SONAME):
        try:
            self.lib = ctypes.CDLL(soname, use_errno=True)
        except OSError as e:
            raise LibbpfError(f"cannot load {soname} (Debian package libbpf1)", errno_mod.ENOENT, str(e)) from None
        L = self.lib
        vp, cp, i, u32, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_size_t
        sig = {
            "bpf_object__open_file": (vp, [cp, vp]),
            "bpf_object__load": (i, [vp]),
            "bpf_object__close": (None, [vp]),
            "bpf_object__name": (cp, [vp]),
            "bpf_object__next_map": (vp, [vp, vp]),
            "bpf_object__next_program": (vp, [vp, vp]),
            "bpf_object__find_map_by_name": (vp, [vp, cp]),
            "bpf_object__find_program_by_name": (vp, [vp, cp]),
            "bpf_map__name": (cp, [vp]),
            "bpf_map__type": (i, [vp]),
            "bpf_map__key_size": (u32, [vp]),
            "bpf_map__value_size": (u32, [vp]),
            "bpf_map__max_entries": (u32, [vp]),
            "bpf_map__set_max_entries": (i, [vp, u32]),
            "bpf_map__initial_value": (vp, [vp, ctypes.POINTER(sz)]),
            "bpf_map__set_initial_value": (i, [vp, vp, sz]),
            "bpf_map__fd": (i, [vp]),
            "bpf_program__name": (cp, [vp]),
            "bpf_program__section_name": (cp, [vp]),
            "bpf_program__fd": (i, [vp]),
            "bpf_program__attach": (vp, [vp]),
            "bpf_link__destroy": (i, [vp]),
            "bpf_map_get_next_key": (i, [i, vp, vp]),
            "bpf_map_lookup_elem": (i, [i, vp, vp]),
            "bpf_map_delete_elem": (i, [i, vp]),
            "bpf_map_lookup_and_delete_elem": (i, [i, vp, vp]),
            # (fd, in_batch, out_batch, keys, values, count, opts): BPF_MAP_LOOKUP_BATCH, bpf(2) cmd 24
            "bpf_map_lookup_batch": (i, [i, vp, vp, vp, vp, ctypes.POINTER(u32), vp]),
            "bpf_obj_get_info_by_fd": (i, [i, vp, ctypes.POINTER(u32)]),
            "libbpf_num_possible_cpus": (i, []),
            "libbpf_set_print": (vp, [_PRINT_FN]),
        }
        for name, (res, args) in sig.items():
            fn = getattr(L, name)
            fn.restype, fn.argtypes = res, args
        self.log = _shared_log()
        L.libbpf_set_print(self.log.callback)

    def version(self) -> str:
        """``libbpf_version_string()`` (libbpf >= 0.7), e.g. ``v1.1``."""
        fn = self.lib.libbpf_version_string
        fn.restype, fn.argtypes = ctypes.c_char_p, []
        return fn().decode()

    def num_possible_cpus(self) -> int:
        n = self.lib.libbpf_num_possible_cpus()
        if n < 0:
            raise LibbpfError("libbpf_num_possible_cpus", -n)
        return n


_log_lock = threading.Lock()
_log: _Log | None = None


def _shared_log() -> _Log:
    global _log
    with _log_lock:
        if _log is None:
            _log = _Log()
        return _log


@dataclass(frozen=True)
class MapInfo:
    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int

    @property
    def type_name(self) -> str:
        return MAP_TYPE_NAMES.get(self.type, str(self.type))


@dataclass(frozen=True)
class ProgramInfo:
    name: str
    section: str


class BpfMap:
    """A loaded map, by file descriptor. Values of per-CPU maps are ``ncpus`` slots of
    ``round_up(value_size, 8)`` bytes (kernel/bpf/syscall.c bpf_map_value_size())."""

    def __init__(self, lb: Libbpf, fd: int, info: MapInfo, ncpus: int):
        self.lb, self.fd, self.info = lb, fd, info
        percpu = info.type in (BPF_MAP_TYPE_PERCPU_HASH, BPF_MAP_TYPE_PERCPU_ARRAY)
        self.slot_size = (info.value_size + 7) // 8 * 8 if percpu else info.value_size
        self.ncpus = ncpus if percpu else 1
        self.value_buf_size = self.slot_size * self.ncpus

    def keys(self) -> Iterator[bytes]:
        """All keys. Deletions while iterating can restart the walk (the kernel's get_next_key on a
        missing key returns the first key), so callers collect keys first and then act on them."""
        ks = self.info.key_size
        prev = None
        nxt = ctypes.create_string_buffer(ks)
        # Bounded: a key deleted under us makes the walk restart, which must not turn into an endless loop.
        for _ in range(2 * self.info.max_entries + 1):
            rc = self.lb.lib.bpf_map_get_next_key(self.fd, prev, nxt)
            if rc == -errno_mod.ENOENT:
                return
            if rc < 0:
                raise LibbpfError(f"bpf_map_get_next_key({self.info.name})", -rc)
            key = nxt.raw
            yield key
            prev = ctypes.create_string_buffer(key, ks)

    def lookup(self, key: bytes) -> bytes | None:
        buf = ctypes.create_string_buffer(self.value_buf_size)
        rc = self.lb.lib.bpf_map_lookup_elem(self.fd, ctypes.create_string_buffer(key, len(key)), buf)
        if rc == -errno_mod.ENOENT:
            return None
        if rc < 0:
            raise LibbpfError(f"bpf_map_lookup_elem({self.info.name})", -rc)
        return buf.raw

    def lookup_and_delete(self, key: bytes) -> bytes | None:
        """Final value and removal in one step (per-CPU hashes: kernel >= 5.14); falls back to
        lookup + delete where the kernel answers EINVAL/ENOTSUPP."""
        buf = ctypes.create_string_buffer(self.value_buf_size)
        kb = ctypes.create_string_buffer(key, len(key))
        rc = self.lb.lib.bpf_map_lookup_and_delete_elem(self.fd, kb, buf)
        if rc == 0:
            return buf.raw
        if rc == -errno_mod.ENOENT:
            return None
        if -rc not in UNSUPPORTED:
            raise LibbpfError(f"bpf_map_lookup_and_delete_elem({self.info.name})", -rc)
        val = self.lookup(key)
        rc = self.lb.lib.bpf_map_delete_elem(self.fd, kb)
        if rc < 0 and rc != -errno_mod.ENOENT:
            raise LibbpfError(f"bpf_map_delete_elem({self.info.name})", -rc)
        return val

    def lookup_batch(self, chunk: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        """Every key and value in a few BPF_MAP_LOOKUP_BATCH calls (bpf(2) cmd 24, kernel >= 5.6 for hash and
        per-CPU hash maps) instead of a get_next_key and a lookup per key: ``(keys, values)``, uint8 arrays of
        shape ``(n, key_size)`` and ``(n, value_buf_size)``. None when the kernel has no batch lookup for this map
        (EINVAL, ENOTSUPP on the first call): the caller walks :meth:`keys` instead.

        ``chunk`` caps the entries asked per call (0: the map's max_entries, i.e. one call and its end mark).
        Semantics from kernel/bpf/hashtab.c __htab_map_lookup_and_delete_batch: the batch token is the next
        bucket; a call returns whole buckets only, ENOSPC (count 0) when the first bucket holds more entries than
        asked, and ENOENT, with the entries of that last call counted, at the end of the map. Entries inserted or
        deleted meanwhile may or may not be seen, as with a key walk."""
        ks, vs = self.info.key_size, self.value_buf_size
        keys = np.empty((max(1, self.info.max_entries), ks), dtype=np.uint8)
        values = np.empty((len(keys), vs), dtype=np.uint8)
        token_in = ctypes.create_string_buffer(max(ks, 8))  # htab's token is a u32; libbpf asks key_size
        token_out = ctypes.create_string_buffer(max(ks, 8))
        count = ctypes.c_uint32()
        fn = self.lb.lib.bpf_map_lookup_batch
        ask = chunk if chunk > 0 else len(keys)
        n = 0
        first = True
        for _ in range(4 * self.info.max_entries + 64):  # bounded, as the key walk
            if n + ask > len(keys):  # entries inserted while reading: make room
                keys = np.concatenate([keys, np.empty_like(keys)])
                values = np.concatenate([values, np.empty_like(values)])
                continue
            count.value = ask
            rc = fn(self.fd, None if first else token_in, token_out, keys[n:].ctypes.data, values[n:].ctypes.data,
                    ctypes.byref(count), None)
            if rc == -errno_mod.ENOSPC and count.value == 0:
                ask *= 2  # one bucket holds more than asked
                continue
            if rc not in (0, -errno_mod.ENOENT):
                if first and -rc in UNSUPPORTED:
                    return None
                raise LibbpfError(f"bpf_map_lookup_batch({self.info.name})", -rc)
            n += count.value
            if rc == -errno_mod.ENOENT:
                return keys[:n], values[:n]
            ctypes.memmove(token_in, token_out, len(token_out))
            first = False
        raise LibbpfError(f"bpf_map_lookup_batch({self.info.name}): no end of map", errno_mod.EAGAIN)

    def slots(self, value: bytes) -> list[bytes]:
        """Split a per-CPU value into its CPU slots (index = CPU number)."""
        return [value[i * self.slot_size:i * self.slot_size + self.info.value_size] for i in range(self.ncpus)]


class BpfObject:
    """An opened (and, after :meth:`load`, loaded) BPF object file. Close it to detach and free."""

    def __init__(self, path: Path, lb: Libbpf | None = None):
        self.lb = lb or Libbpf()
        self.path = Path(path)
        self.links: list[int] = []
        self.loaded = False
        with self.lb.log.lock:
            self.lb.log.capture = True
            ptr = self.lb.lib.bpf_object__open_file(str(self.path).encode(), None)
            err = ctypes.get_errno()
            log = self.lb.log.take()
            self.lb.log.capture = False
        if not ptr:
            raise LibbpfError(f"bpf_object__open_file({self.path})", err or errno_mod.EINVAL, log)
        self.ptr = ptr

    # -- description (no privileges needed) ------------------------------------------------------------
    def _maps(self) -> Iterator[int]:
        m = None
        while True:
            m = self.lb.lib.bpf_object__next_map(self.ptr, m)
            if not m:
                return
            yield m

    def _map_info(self, m: int) -> MapInfo:
        L = self.lb.lib
        return MapInfo(L.bpf_map__name(m).decode(), L.bpf_map__type(m), L.bpf_map__key_size(m),
                       L.bpf_map__value_size(m), L.bpf_map__max_entries(m))

    def maps(self) -> dict[str, MapInfo]:
        return {i.name: i for i in (self._map_info(m) for m in self._maps())}

    def programs(self) -> list[ProgramInfo]:
        out: list[ProgramInfo] = []
        p, L = None, self.lb.lib
        while True:
            p = L.bpf_object__next_program(self.ptr, p)
            if not p:
                return out
            out.append(ProgramInfo(L.bpf_program__name(p).decode(), L.bpf_program__section_name(p).decode()))

    def _find_map(self, name: str) -> int:
        m = self.lb.lib.bpf_object__find_map_by_name(self.ptr, name.encode())
        if not m:
            raise LibbpfError(f"map {name!r} not in {self.path}", errno_mod.ENOENT)
        return m

    def rodata_map_name(self) -> str | None:
        """libbpf names the .rodata map ``<object name>.rodata`` (truncated to 15 characters)."""
        for info in self.maps().values():
            if info.name.endswith(".rodata"):
                return info.name
        return None

    # -- configuration before load ---------------------------------------------------------------------
    def set_max_entries(self, map_name: str, n: int) -> None:
        rc = self.lb.lib.bpf_map__set_max_entries(self._find_map(map_name), n)
        if rc < 0:
            raise LibbpfError(f"bpf_map__set_max_entries({map_name}, {n})", -rc)

    def initial_value(self, map_name: str) -> bytes:
        size = ctypes.c_size_t(0)
        p = self.lb.lib.bpf_map__initial_value(self._find_map(map_name), ctypes.byref(size))
        if not p:
            raise LibbpfError(f"bpf_map__initial_value({map_name})", errno_mod.EINVAL)
        return ctypes.string_at(p, size.value)

    def set_initial_value(self, map_name: str, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        rc = self.lb.lib.bpf_map__set_initial_value(self._find_map(map_name), buf, len(data))
        if rc < 0:
            raise LibbpfError(f"bpf_map__set_initial_value({map_name}, {len(data)} bytes)", -rc)

    # -- load, attach, read ---------------------------------------------------------------------------
    def load(self) -> None:
        with self.lb.log.lock:
            self.lb.log.capture = True
            rc = self.lb.lib.bpf_object__load(self.ptr)
            log = self.lb.log.take()
            self.lb.log.capture = False
        if rc < 0:
            raise LibbpfError(f"bpf_object__load({self.path.name})", -rc, log)
        self.loaded = True

    def attach_all(self) -> None:
        """Attach every program by its section name (``tp_btf/<tracepoint>`` and the like)."""
        L = self.lb.lib
        p = None
        while True:
            p = L.bpf_object__next_program(self.ptr, p)
            if not p:
                return
            name = L.bpf_program__name(p).decode()
            with self.lb.log.lock:
                self.lb.log.capture = True
                link = L.bpf_program__attach(p)
                err = ctypes.get_errno()
                log = self.lb.log.take()
                self.lb.log.capture = False
            if not link:
                raise LibbpfError(f"bpf_program__attach({name})", err or errno_mod.EINVAL, log)
            self.links.append(link)

    def program_ids(self) -> dict[str, int]:
        """Kernel ids of the loaded programs (what ``bpftool prog show id N`` takes). struct bpf_prog_info
        starts with ``__u32 type; __u32 id;`` (include/uapi/linux/bpf.h); the kernel fills at most the
        length passed and accepts a zeroed tail beyond the fields it knows."""
        out: dict[str, int] = {}
        p, L = None, self.lb.lib
        while True:
            p = L.bpf_object__next_program(self.ptr, p)
            if not p:
                return out
            buf = ctypes.create_string_buffer(256)
            n = ctypes.c_uint32(len(buf))
            rc = L.bpf_obj_get_info_by_fd(L.bpf_program__fd(p), buf, ctypes.byref(n))
            if rc < 0:
                raise LibbpfError("bpf_obj_get_info_by_fd", -rc)
            out[L.bpf_program__name(p).decode()] = int.from_bytes(buf.raw[4:8], "little")

    def map(self, name: str) -> BpfMap:
        m = self._find_map(name)
        fd = self.lb.lib.bpf_map__fd(m)
        if fd < 0:
            raise LibbpfError(f"bpf_map__fd({name}): object not loaded", -fd)
        return BpfMap(self.lb, fd, self._map_info(m), self.lb.num_possible_cpus())

    def close(self) -> None:
        for link in self.links:
            self.lb.lib.bpf_link__destroy(link)
        self.links = []
        if self.ptr:
            self.lb.lib.bpf_object__close(self.ptr)
            self.ptr = None

    def __enter__(self) -> BpfObject:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
