"""State files written whole or not at all, and read back or moved aside.

A save writes a temporary file in the same directory, looping until every byte is written (write(2) may
write less than asked: a full disk shows up as a short write first and ENOSPC next), fsyncs it, renames it
over the old file (rename(2) is atomic within a filesystem) and fsyncs the directory so that the rename
survives a crash too. Any failure removes the temporary file and leaves the previous file as it was.

A file that cannot be read, is not JSON, or is JSON of the wrong shape is renamed to
``<name>.corrupt-<unix time>`` (kept for whoever investigates) and the caller starts empty and rebuilds
from the runtime.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .model import Cache


class SaveError(OSError):
    """A save that failed; the previous file is unchanged."""


def write_whole(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` atomically; raises OSError (the old file stays) on any failure."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if n <= 0:  # never for regular files, but a zero-byte write must not loop forever
                raise OSError(f"write of {path} made no progress")
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@dataclass(frozen=True)
class Loaded:
    cache: Cache
    note: str | None = None  # why the file was not used, when it was not
    moved_to: Path | None = None  # where a corrupt file went


def load_cache(path: Path, clock_s: float | None = None) -> Loaded:
    """The saved cache; an empty one when there is none; an empty one and the corrupt file moved aside
    when it cannot be used."""
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return Loaded(Cache())
    except OSError as e:
        return _aside(path, f"unreadable cache {path}: {e}", clock_s)
    try:
        return Loaded(Cache.from_json(text))
    except (ValueError, TypeError) as e:
        return _aside(path, f"unusable cache {path}: {e}", clock_s)


def _aside(path: Path, why: str, clock_s: float | None) -> Loaded:
    stamp = int(clock_s if clock_s is not None else time.time())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():  # two in one second: keep both
        target = path.with_name(f"{path.name}.corrupt-{stamp}.{n}")
        n += 1
    try:
        os.replace(path, target)
    except OSError as e:
        return Loaded(Cache(), f"{why}; could not move it aside: {e}")
    return Loaded(Cache(), f"{why}; moved to {target.name}, rebuilding from the runtime", target)
