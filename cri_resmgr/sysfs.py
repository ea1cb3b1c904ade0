"""Small helpers for reading kernel text files. Parsing is kept apart from reading."""

from __future__ import annotations

import os
from pathlib import Path
from typing import overload


def parse_cpulist(text: str) -> frozenset[int]:
    """Parse a kernel CPU list such as ``0-3,8,10-11`` (Documentation/admin-guide/cputopology.rst).

    An empty string (as in an empty ``offline`` file) is the empty set.
    Raises ValueError on malformed input.
    """
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        return frozenset()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty element in cpu list {text!r}")
        if "-" in part:
            lo_s, _, hi_s = part.partition("-")
            # "0-7:2/4" stride syntax exists only for boot parameters, not in sysfs.
            lo, hi = int(lo_s), int(hi_s)
            if hi < lo:
                raise ValueError(f"descending range {part!r} in cpu list")
            cpus.update(range(lo, hi + 1))
        else:
            cpus.add(int(part))
    return frozenset(cpus)


def format_cpulist(cpus) -> str:
    """Inverse of :func:`parse_cpulist`: ``{0,1,2,5}`` -> ``0-2,5``."""
    s = sorted(cpus)
    out: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def parse_size(text: str) -> int:
    """Cache sizes in sysfs are like ``32768K`` (drivers/base/cacheinfo.c prints ``%uK``)."""
    t = text.strip()
    mult = {"K": 1024, "M": 1024**2, "G": 1024**3}
    if t and t[-1].upper() in mult:
        return int(t[:-1]) * mult[t[-1].upper()]
    return int(t)


def read_text(path: Path | str, default: str | None = None) -> str | None:
    """Read a small text file; return ``default`` when it is absent or unreadable.

    Plain ``os.open``/``os.read`` rather than ``open()``: collectors read thousands of these per cycle and the
    buffered text layer costs several times the syscalls themselves.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return default
    try:
        chunks = []
        while True:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        # Some sysfs attributes answer EINVAL/ENODEV on read when the device is gone.
        return default
    finally:
        os.close(fd)


@overload
def read_int(path: Path | str, default: int) -> int: ...
@overload
def read_int(path: Path | str, default: None = None) -> int | None: ...
def read_int(path: Path | str, default: int | None = None) -> int | None:
    t = read_text(path)
    if t is None:
        return default
    try:
        return int(t.strip())
    except ValueError:
        return default


def read_cpulist(path: Path | str) -> frozenset[int] | None:
    """Read a CPU-list file; None when absent, unreadable or malformed."""
    t = read_text(path)
    if t is None:
        return None
    try:
        return parse_cpulist(t)
    except ValueError:
        return None


def parse_flat_keyed(text: str) -> dict[str, int]:
    """Parse ``key value`` lines (cgroup ``cpu.stat``, ``memory.stat``; Documentation/admin-guide/cgroup-v2.rst,
    "Format"). Lines that do not have exactly an integer value are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            out[parts[0]] = int(parts[1])
        except ValueError:
            continue
    return out
