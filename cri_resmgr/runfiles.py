"""Files a process keeps in ``run_dir``: its single-instance lock and the unix sockets it listens on.

The lock is flock(2) on a file that names the holder's pid: the kernel drops the lock when the holder dies, so a
crash never blocks a restart (a stale pid in the file is only informative). A socket path is taken over only
when nothing accepts connections on it: a live listener (another instance, another front end) is never stolen.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

log = logging.getLogger(__name__)


class StartupError(Exception):
    """A front end (relay, NRI plugin) cannot start; the message says why. ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class AlreadyRunning(Exception):
    """Another process holds the lock (the message names its pid)."""


class SocketInUse(Exception):
    """Something listens on the socket path, or the path is not a socket."""


def acquire_lock(path: Path, what: str) -> int:
    """Hold ``path`` exclusively for this process's lifetime; returns the descriptor (close it to release).
    Raises :class:`AlreadyRunning` naming ``what`` ("an NRI plugin") and the holder's pid."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise AlreadyRunning(f"{what} is already running (pid {holder}); lock {path}") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def claim_socket(path: Path, timeout: float = 1.0) -> None:
    """Make ``path`` free for a new listener: remove it only if it is a socket nobody accepts connections on.
    Raises :class:`SocketInUse` otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_socket():
        raise SocketInUse(f"{path} exists and is not a socket; not touching it")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s (nothing listens on it)", path)
        path.unlink(missing_ok=True)
        return
    except OSError as e:
        raise SocketInUse(f"cannot tell whether {path} is in use: {e}") from None
    finally:
        s.close()
    raise SocketInUse(f"something is listening on {path} already")


def claim_run_dirs(run_dir: Path, state_dir: Path, lock_name: str, what: str) -> int:
    """A front end's start: its run directory (0750) and state directory (0700) exist, and this process holds
    ``run_dir/lock_name`` (returns the descriptor). Raises :class:`StartupError` saying what stands in the way."""
    for d, mode in ((run_dir, 0o750), (state_dir, 0o700)):
        try:
            d.mkdir(parents=True, exist_ok=True, mode=mode)
        except OSError as e:
            raise StartupError(f"cannot create {d}: {e.strerror}") from None
    try:
        return acquire_lock(run_dir / lock_name, what)
    except AlreadyRunning as e:
        raise StartupError(str(e)) from None
