"""NRI plugin: pod lifecycles through a containerd 1.7 with the plugin against one without, in the same run,
interleaved; and the plugin's own answer latency per hook.

Starts two private containerd 1.7 daemons (Debian 13's package, fetched once into a cache:
tests/integration/nri/containerd17.py), both with NRI enabled; ``cri-resmgr nri`` (its own process) registers
with the first only. Then whole pod lifecycles (RunPodSandbox, CreateContainer, StartContainer, StopContainer,
RemoveContainer, StopPodSandbox, RemovePodSandbox), alternating BestEffort and Guaranteed 1-CPU pods (the
exclusive path, with its shared-pool updates), are driven against both daemons in turn: median and p90 wall
time of each, and their ratio. The hook latency is the time from the request's arrival to the plugin's answer,
as the plugin measures it (logged at debug level per request).

Needs root, runc, busybox-static and access to the Debian archive (or a filled cache).

    nice .venv/bin/python bench/nri_bench.py [--lifecycles 40]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _util  # noqa: F401  (puts the repo on sys.path)

from tests.integration.cri import CriClient, Kubelet, PodSpec, container_config, guaranteed
from tests.integration.nri.containerd17 import FetchError
from tests.integration.nri.harness import NriPluginProcess, start_containerd17


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def lifecycle(k: Kubelet, i: int) -> float:
    exclusive = i % 2 == 1
    t0 = time.perf_counter()
    pod = k.run_pod(PodSpec(f"bench-{i}", qos="Guaranteed" if exclusive else "BestEffort"))
    cfg = guaranteed("app", 1000) if exclusive else container_config("app")
    cid = k.run_container(pod, cfg)
    k.stop_remove_container(cid)
    pod.containers.clear()
    k.stop_remove_pod(pod)
    return time.perf_counter() - t0


def cpu_seconds(pid: int) -> float:
    # proc(5): /proc/<pid>/stat fields 14 and 15 are utime and stime in clock ticks
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def hook_latencies(log: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for ev, _result, sec in re.findall(r"request (\w+) (\w+) ([0-9.]+)s", log):
        out.setdefault(ev, []).append(float(sec))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lifecycles", type=int, default=40, help="per daemon")
    ap.add_argument("--state-dir", type=Path, default=None,
                    help="the plugin's state_dir (default: on disk under the bench's temporary directory); "
                         "e.g. a tmpfs directory to see the cost of the engine's cache fsyncs")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crirm-nri-bench-"))
    try:
        with_plugin = start_containerd17(tmp / "with")
        plain = start_containerd17(tmp / "plain")
    except FetchError as e:
        print(f"skipped: containerd 1.7 not available: {e}")
        return 0
    # production settings (the tests' harness reconciles every second)
    cfg = {"log_level": "debug", "relay": {"reconcile_interval_seconds": 5}}
    if args.state_dir:
        cfg["state_dir"] = str(args.state_dir)
    plugin = NriPluginProcess(tmp / "nri", with_plugin.nri_socket, cfg)
    kw = Kubelet(CriClient(with_plugin.socket), with_plugin.cgroup_parent, tmp / "logs-with")
    kp = Kubelet(CriClient(plain.socket), plain.cgroup_parent, tmp / "logs-plain")
    try:
        plugin.start()
        for i in range(4):  # warm-up: images, shims, caches
            lifecycle(kw, i)
            lifecycle(kp, i)
        lat: dict[str, list[float]] = {"without plugin": [], "with plugin": []}
        cpu0 = cpu_seconds(plugin.proc.pid)
        for i in range(args.lifecycles):
            # alternate which daemon goes first so that neither always runs right after the other
            order = (("with plugin", kw), ("without plugin", kp)) if i % 2 else (("without plugin", kp),
                                                                                ("with plugin", kw))
            for name, k in order:
                lat[name].append(lifecycle(k, i))
        print(f"pod lifecycles x{args.lifecycles} per daemon (BestEffort and Guaranteed 1-CPU alternating), "
              f"{plugin.client().state().runtime or 'containerd 1.7'}; plugin state_dir "
              f"{plugin.config['state_dir']}")
        print(f"{'':>16} {'median ms':>10} {'p90 ms':>8}")
        for name, xs in lat.items():
            print(f"{name:>16} {statistics.median(xs) * 1e3:10.1f} {pct(xs, 0.9) * 1e3:8.1f}")
        ratio = statistics.median(lat["with plugin"]) / statistics.median(lat["without plugin"])
        paired = statistics.median(w / wo for w, wo in zip(lat["with plugin"], lat["without plugin"], strict=True))
        print(f"ratio of medians (with / without): {ratio:.3f}; median of paired ratios: {paired:.3f} "
              f"(target <= 1.02)")
        cpu = cpu_seconds(plugin.proc.pid) - cpu0
        print(f"plugin process CPU time: {cpu * 1e3 / args.lifecycles:.1f} ms per lifecycle (all its threads: "
              f"hooks, cache persistence, reconcile)")
        hooks = hook_latencies(plugin.log())
        print(f"\nhook answer latency inside the plugin (request decoded -> answer ready), over "
              f"{sum(len(v) for v in hooks.values())} requests")
        print(f"{'event':>18} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        for ev in sorted(hooks):
            xs = hooks[ev]
            print(f"{ev:>18} {len(xs):5d} {pct(xs, 0.5) * 1e3:8.3f} {pct(xs, 0.99) * 1e3:8.3f} {max(xs) * 1e3:8.3f}")
        create = hooks.get("CreateContainer", [])
        if create:
            print(f"CreateContainer p99 {pct(create, 0.99) * 1e3:.3f} ms (target <= 2 ms; containerd's timeout 2 s)")
    finally:
        plugin.stop()
        for k in (kw, kp):
            k.cleanup()
            k.c.close()
        for c in (with_plugin, plain):
            problems = c.cleanup()
            if problems:
                print("cleanup problems:", problems, file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
