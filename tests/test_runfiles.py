"""run_dir files: the single-instance lock against a real second process, and socket paths taken over only
when nobody listens on them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from cri_resmgr.runfiles import AlreadyRunning, SocketInUse, acquire_lock, claim_socket

HOLDER = """
import sys, time
from pathlib import Path
from cri_resmgr.runfiles import acquire_lock
acquire_lock(Path(sys.argv[1]), "the holder")
print("held", flush=True)
time.sleep(60)
"""


def test_lock_held_by_another_process_names_its_pid_and_frees_when_it_dies(tmp_path):
    lock = tmp_path / "x.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AlreadyRunning) as e:
            acquire_lock(lock, "an NRI plugin")
        assert f"an NRI plugin is already running (pid {holder.pid})" in str(e.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    fd = acquire_lock(lock, "an NRI plugin")  # the kernel dropped the dead holder's lock
    try:
        assert lock.read_text().strip() == str(os.getpid())
    finally:
        os.close(fd)


def test_stale_socket_is_removed_and_a_live_one_is_not(tmp_path):
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # the path stays, nobody listens
    claim_socket(stale)
    assert not stale.exists()
    live = tmp_path / "live.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(live))
    srv.listen(1)
    try:
        with pytest.raises(SocketInUse):
            claim_socket(live)
        assert live.is_socket()
    finally:
        srv.close()


def test_a_file_that_is_not_a_socket_is_never_touched(tmp_path):
    f = tmp_path / "not-a.sock"
    f.write_text("data")
    with pytest.raises(SocketInUse):
        claim_socket(f)
    assert f.read_text() == "data"
