"""NRI hook latency while another thread of the plugin holds the interpreter: what ``sys.setswitchinterval`` buys.

The plugin answers hooks on its connection's reader thread, which sleeps in ``recv`` (interpreter released)
between requests. When a request arrives while one of the engine's threads runs Python code (a cache save's
JSON encoding, a reconcile), the reader waits for the interpreter until that thread blocks or is made to drop it
after the switch interval (CPython's default 5 ms). This runs the real handlers (CreateContainer of a
Guaranteed 1-CPU container with shared containers to move, then StopContainer) on the `this-vm` fixture
topology, each after a short sleep like the reader's, with and without a thread that keeps saving the engine's
cache, for several switch intervals. Latency = from the end of the sleep to the answer's bytes.

    nice .venv/bin/python bench/nri_gil_bench.py [--hooks 400]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import _util  # noqa: F401  (puts the repo on sys.path)

from cri_resmgr.nri.plugin import NriPort, Plugin, RuntimeView
from cri_resmgr.nri.proto import nri_pb2 as api
from cri_resmgr.nri.ttrpc import Call
from cri_resmgr.placement.engine import Engine, EngineSettings
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def make(tmp: Path, shared: int) -> Plugin:
    topo = discover(build_sysfs(MACHINES["this-vm"], tmp / "sys"))
    (tmp / "state").mkdir()
    view = RuntimeView()
    port = NriPort(view, lambda: None)
    engine = Engine(EngineSettings(), topo, tmp / "state", port, cgroup_root=tmp / "no-cgroups",
                    cache_name="nri-cache.json")
    plugin = Plugin(engine, view, port)
    pods, ctrs = [], []
    for i in range(shared):
        p = api.PodSandbox(id=f"pod-be{i}", name=f"be{i}", uid=f"be{i}", namespace="default")
        p.linux.cgroup_parent = f"/kubepods/besteffort/podbe{i}"
        c = api.Container(id=f"be{i}", pod_sandbox_id=p.id, name="app", state=api.CONTAINER_RUNNING)
        c.linux.resources.cpu.shares.value = 2
        c.linux.resources.cpu.cpus = "0-1"
        pods.append(p)
        ctrs.append(c)
    plugin.synchronize(api.SynchronizeRequest(pods=pods, containers=ctrs).SerializeToString(),
                       Call("Synchronize", time.monotonic() + 5))
    return plugin


def run(plugin: Plugin, hooks: int, gap: float) -> list[float]:
    m = plugin.methods()
    g = api.PodSandbox(id="pod-g", name="g", uid="g", namespace="default")
    g.linux.cgroup_parent = "/kubepods/podg"
    out = []
    for i in range(hooks // 2):
        c = api.Container(id=f"g{i}", pod_sandbox_id=g.id, name="app")
        r = c.linux.resources
        r.cpu.shares.value, r.cpu.quota.value, r.cpu.period.value = 1024, 100000, 100000
        r.memory.limit.value = 64 << 20
        for name, raw in (("CreateContainer", api.CreateContainerRequest(pod=g, container=c).SerializeToString()),
                          ("StopContainer", api.StopContainerRequest(pod=g, container=api.Container(id=c.id))
                           .SerializeToString())):
            t_wake = time.perf_counter() + gap
            time.sleep(gap)  # the reader in recv(): interpreter released
            call = Call(name, time.monotonic() + 5)
            m[name].handler(raw, call)
            out.append(time.perf_counter() - t_wake)
            call.run_after()
        plugin.engine.removed(c.id)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hooks", type=int, default=400)
    ap.add_argument("--shared", type=int, default=20, help="running shared containers each exclusive hook moves")
    ap.add_argument("--gap", type=float, default=0.003, help="seconds between hooks")
    args = ap.parse_args()
    print(f"{args.hooks} hooks (CreateContainer/StopContainer of a Guaranteed 1-CPU container, {args.shared} "
          f"shared containers moved each time), {args.gap * 1e3:.0f} ms apart")
    print(f"{'switch interval':>16} {'background':>26} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    default = sys.getswitchinterval()
    for interval in (default, 0.001, 0.0005):
        for busy in (False, True):
            with tempfile.TemporaryDirectory(prefix="crirm-gil-") as tmp:
                plugin = make(Path(tmp), args.shared)
                stop = threading.Event()

                def saver(p: Plugin = plugin, stop: threading.Event = stop) -> None:
                    while not stop.is_set():
                        p.engine.cache.to_json()  # a save's Python part (the writes release the interpreter)

                t = threading.Thread(target=saver, daemon=True)
                sys.setswitchinterval(interval)
                if busy:
                    t.start()
                try:
                    xs = run(plugin, args.hooks, args.gap)
                finally:
                    stop.set()
                    if busy:
                        t.join()
                    sys.setswitchinterval(default)
                    plugin.engine.stop()
            print(f"{interval * 1e3:13.1f} ms {'a thread saving the cache' if busy else 'idle':>26} "
                  f"{pct(xs, 0.5) * 1e3:8.3f} {pct(xs, 0.9) * 1e3:8.3f} {pct(xs, 0.99) * 1e3:8.3f} "
                  f"{max(xs) * 1e3:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
