"""NRI plugin at rest: CPU time and thread wake-ups while nothing happens.

Every wake-up of one of the plugin's threads costs CPU, and when it lands while a hook runs it takes the
interpreter from that hook (issue 15). This starts a private containerd 1.7 with NRI
(tests/integration/nri/containerd17.py), registers ``cri-resmgr nri`` with it (production settings: reconcile
every 5 s, info logging), lets it settle, then counts over ``--seconds`` the plugin process's CPU time
(/proc/<pid>/stat utime + stime) and each thread's voluntary context switches (proc(5)
/proc/<pid>/task/<tid>/status ``voluntary_ctxt_switches``: one per time the thread went to sleep, so one per
wake-up of a sleeping thread).

Needs root, runc, busybox-static and access to the Debian archive (or a filled cache).

    nice .venv/bin/python bench/nri_idle_bench.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _util import cpu_seconds  # (importing _util puts the repo on sys.path)

from tests.integration.nri.containerd17 import FetchError
from tests.integration.nri.harness import NriPluginProcess, start_containerd17


def switches(pid: int) -> dict[int, int]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    out[int(task.name)] = int(line.split()[1])
        except OSError:
            continue  # the thread ended meanwhile
    return out


def thread_names(pid: int) -> dict[int, str]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = (task / "comm").read_text().strip()  # proc(5): set by the thread, or the program's
        except OSError:
            continue
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=12.0, help="seconds after registering before counting")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crirm-nri-idle-"))
    try:
        daemon = start_containerd17(tmp / "c")
    except FetchError as e:
        print(f"skipped: containerd 1.7 not available: {e}")
        return 0
    plugin = NriPluginProcess(tmp / "nri", daemon.nri_socket, {"relay": {"reconcile_interval_seconds": 5}})
    try:
        plugin.start()
        assert plugin.proc is not None
        pid = plugin.proc.pid
        time.sleep(args.settle)
        cpu0, sw0 = cpu_seconds(pid), switches(pid)
        time.sleep(args.seconds)
        cpu1, sw1 = cpu_seconds(pid), switches(pid)
        woke = {tid: sw1[tid] - sw0.get(tid, 0) for tid in sw1}
        names = thread_names(pid)
        busy = sorted(((n, names.get(tid, "?")) for tid, n in woke.items() if n), reverse=True)
        print(f"NRI plugin idle for {args.seconds:.0f} s (registered, no pods): CPU {cpu1 - cpu0:.3f} s "
              f"({(cpu1 - cpu0) / args.seconds * 1e3:.2f} ms/s); wake-ups {sum(woke.values())} "
              f"({sum(woke.values()) / args.seconds:.1f}/s) in {len(busy)} of {len(woke)} threads: "
              + ", ".join(f"{name} {n}" for n, name in busy))
    finally:
        plugin.stop()
        problems = daemon.cleanup()
        if problems:
            print("cleanup problems:", problems, file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
