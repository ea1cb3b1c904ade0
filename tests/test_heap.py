"""heap.release_free_heap gives freed C heap memory back to the OS (glibc malloc_trim)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cri_resmgr.heap import _malloc_trim, release_free_heap


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(_malloc_trim() is None, reason="C library without malloc_trim (not glibc)")
def test_memory_freed_by_a_thread_leaves_the_rss_after_release():
    """64 MB in 64 KB pieces (below the mmap threshold: from the heap), freed but for one piece allocated last,
    stay in the RSS until released."""
    seen = {}

    def churn():
        pieces = [bytearray(64 << 10) for _ in range(1024)]  # written: the pages are resident
        keep = bytearray(64 << 10)  # noqa: F841 - above the freed ones: the heap cannot just shrink
        del pieces
        seen["freed"] = rss_mib()
        assert release_free_heap()
        seen["released"] = rss_mib()

    t = threading.Thread(target=churn)
    t.start()
    t.join()
    assert seen["freed"] - seen["released"] > 32, seen


MMAP_CHILD = """
import ctypes, sys
sys.path.insert(0, {repo!r})
from cri_resmgr.heap import fix_mmap_threshold
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MI
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
elif sys.argv[1] == "agent":  # what the agent's start does, on a node of fixture files
    from cri_resmgr.agent import Agent
    from cri_resmgr.config import build_config
    from cri_resmgr.topology.fixtures import MACHINES, build_sysfs
    tmp = sys.argv[2]
    sysfs = build_sysfs(MACHINES["small-offline-isolated"], tmp + "/sys")
    for d in ("cgroup", "proc"):
        __import__("os").makedirs(tmp + "/" + d)
    cfg = build_config({{"state_dir": tmp + "/state", "run_dir": tmp + "/run",
                         "paths": {{"sysfs": str(sysfs), "cgroup": tmp + "/cgroup", "proc": tmp + "/proc"}},
                         "collectors": {{"cgroup": {{"interval_seconds": 3600}},
                                         "cpu": {{"interval_seconds": 3600}}}}}},
                       env={{"NODE_NAME": "t"}})
    agent = Agent(cfg)
    agent.start()
    agent.stop()
a = bytearray(4 << 20)
del a  # glibc's dynamic threshold rises to 4 MB here unless it was fixed
base = libc.mallinfo2().hblkhd
b = bytearray(2 << 20)
print(libc.mallinfo2().hblkhd - base)
"""


@pytest.mark.skipif(_malloc_trim() is None, reason="C library without malloc_trim (not glibc)")
def test_fixed_mmap_threshold_keeps_large_temporaries_out_of_the_heap(tmp_path: Path):
    """After a 4 MB block was freed, glibc serves the next 2 MB block from the heap (whose holes stay in the RSS)
    unless the agent fixed the mmap threshold: then it is mmapped (and unmapped when freed)."""
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parent.parent)

    def mmapped(mode: str) -> int:
        code = MMAP_CHILD.format(repo=repo)
        r = subprocess.run([sys.executable, "-c", code, mode, str(tmp_path)], capture_output=True, text=True,
                           check=True)
        return int(r.stdout.split()[-1])

    assert mmapped("dynamic") < 1 << 20  # the test would not see the difference otherwise
    assert mmapped("fixed") >= 2 << 20
    assert mmapped("agent") >= 2 << 20  # Agent.start() fixes it


ARENA_CHILD = """
import ctypes, re, sys, threading
sys.path.insert(0, {repo!r})
from cri_resmgr.heap import limit_arenas
if sys.argv[1] == "limited":
    assert limit_arenas(2)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fdopen.restype = ctypes.c_void_p
libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
start, done = threading.Barrier(9), threading.Event()

def work():  # every thread allocates while the others hold their arenas: without a cap, one arena each
    start.wait()
    ps = [libc.malloc(1000) for _ in range(20000)]
    done.wait()
    for p in ps:
        libc.free(p)

ts = [threading.Thread(target=work) for _ in range(8)]
for t in ts:
    t.start()
start.wait()
import os, tempfile
with tempfile.TemporaryFile() as f:
    fp = libc.fdopen(os.dup(f.fileno()), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    f.seek(0)
    print(len(re.findall(rb'<heap nr=', f.read())))
done.set()
for t in ts:
    t.join()
"""


@pytest.mark.skipif(_malloc_trim() is None, reason="C library without malloc_trim (not glibc)")
def test_limited_arenas_make_threads_share_them():
    """Eight threads allocating at once get arenas of their own (glibc: up to 8 per core) unless the arenas were
    limited: then they share two."""
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parent.parent)

    def arenas(mode: str) -> int:
        r = subprocess.run([sys.executable, "-c", ARENA_CHILD.format(repo=repo), mode], capture_output=True,
                           text=True, check=True)
        return int(r.stdout.split()[-1])

    assert arenas("limited") <= 2
    assert arenas("default") > 2  # the test would not see the difference otherwise


def test_agent_start_limits_the_arenas(tmp_path: Path, monkeypatch):
    """Agent.start() caps the malloc arenas before it starts its threads."""
    from cri_resmgr import agent as agent_mod
    from cri_resmgr.config import build_config
    from cri_resmgr.topology.fixtures import MACHINES, build_sysfs

    calls: list[str] = []
    monkeypatch.setattr(agent_mod, "limit_arenas", lambda: calls.append("arenas") or True)
    real_start = agent_mod.Agent._start_thread

    def start_thread(self, name):
        calls.append("thread")
        real_start(self, name)

    monkeypatch.setattr(agent_mod.Agent, "_start_thread", start_thread)
    sysfs = build_sysfs(MACHINES["small-offline-isolated"], tmp_path / "sys")
    for d in ("cgroup", "proc"):
        (tmp_path / d).mkdir()
    cfg = build_config({"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                        "paths": {"sysfs": str(sysfs), "cgroup": str(tmp_path / "cgroup"),
                                  "proc": str(tmp_path / "proc")},
                        "collectors": {"cgroup": {"interval_seconds": 3600}, "cpu": {"interval_seconds": 3600}}},
                       env={"NODE_NAME": "t"})
    a = agent_mod.Agent(cfg)
    a.start()
    a.stop()
    assert calls[0] == "arenas" and "thread" in calls
