"""NRI plugin: pod lifecycles through a containerd 1.7 with the plugin against one without, in the same run,
interleaved; and the plugin's own answer latency per hook.

Starts two private containerd 1.7 daemons (Debian 13's package, fetched once into a cache:
tests/integration/nri/containerd17.py), both with NRI enabled; ``cri-resmgr nri`` (its own process) registers
with the first only. Then whole pod lifecycles (RunPodSandbox, CreateContainer, StartContainer, StopContainer,
RemoveContainer, StopPodSandbox, RemovePodSandbox), alternating BestEffort and Guaranteed 1-CPU pods (the
exclusive path, with its shared-pool updates; ``--pods besteffort``: BestEffort only, where no pool update is
ever needed), are driven against the daemons in turn: median and p90 wall time of each, and their ratios.

A third daemon has a do-nothing NRI plugin (bench/nri_null_plugin.py: same events, empty answers at once), so the
overhead splits honestly into containerd's own per-event NRI cost (null / without: building the messages, the
round trips; no placement plugin can avoid it) and cri-resmgr's (with / null: its hooks, the updates its answers
make containerd apply, its CPU). The hook latency is the time from the request's arrival to the plugin's answer,
as the plugin measures it (logged at debug level per request); for every answer over 2 ms, where its time went
by the plugin's own trace (cri_resmgr/nri/trace.py: on a CPU, waiting for one, asleep, stolen by the hypervisor,
other threads' CPU, garbage collection), and the plugin's GC pauses over the run.

Needs root, runc, busybox-static and access to the Debian archive (or a filled cache).

    nice .venv/bin/python bench/nri_bench.py [--lifecycles 40] [--background N] [--keep-log FILE]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _util import cpu_seconds  # (importing _util puts the repo on sys.path)

from tests.integration.cri import CriClient, Kubelet, PodSpec, container_config, guaranteed
from tests.integration.nri.containerd17 import FetchError
from tests.integration.nri.harness import NriPluginProcess, start_containerd17


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def lifecycle(k: Kubelet, i: int, pods: str = "mixed") -> float:
    exclusive = pods == "mixed" and i % 2 == 1
    t0 = time.perf_counter()
    pod = k.run_pod(PodSpec(f"bench-{i}", qos="Guaranteed" if exclusive else "BestEffort"))
    cfg = guaranteed("app", 1000) if exclusive else container_config("app")
    cid = k.run_container(pod, cfg)
    k.stop_remove_container(cid)
    pod.containers.clear()
    k.stop_remove_pod(pod)
    return time.perf_counter() - t0


def cpu_times() -> list[int]:
    # proc(5): /proc/stat "cpu" line: user nice system idle iowait irq softirq steal ... in clock ticks
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def hook_latencies(log: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for ev, _result, sec in re.findall(r"request (\w+) (\w+) ([0-9.]+)s", log):
        out.setdefault(ev, []).append(float(sec))
    return out


SLOW = re.compile(r"slow NRI answer: (\w+) ([0-9.]+) ms: cpu ([0-9.]+), run queue ([0-9.]+), blocked ([0-9.]+), "
                  r"steal ([0-9.]+) \(other threads on a CPU ([0-9.]+), GC ([0-9.]+);.*?cause (\w+)")


def slow_answers(log: str) -> list[tuple[str, float, float, float, float, float, float, float, str]]:
    """The plugin's "slow NRI answer" lines (cri_resmgr/nri/trace.py): event, wall, cpu, run queue, blocked,
    steal, other threads' CPU, GC (ms), cause."""
    return [(ev, *map(float, nums), cause) for ev, *nums, cause in SLOW.findall(log)]


def gc_line(metrics: str) -> str:
    got = {(k, g): float(v) for k, g, v in re.findall(
        r'^cri_resmgr_nri_gc_(pauses_total|pause_time_seconds_total)\{generation="(\d)"\} (\S+)', metrics, re.M)}
    return ", ".join(f"gen {g}: {got.get(('pauses_total', g), 0):.0f} "
                     f"({got.get(('pause_time_seconds_total', g), 0) * 1e3:.1f} ms)" for g in "012")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lifecycles", type=int, default=40, help="per daemon")
    ap.add_argument("--state-dir", type=Path, default=None,
                    help="the plugin's state_dir (default: on disk under the bench's temporary directory); "
                         "e.g. a tmpfs directory to see the cost of the engine's cache fsyncs")
    ap.add_argument("--pods", choices=("mixed", "besteffort"), default="mixed",
                    help="mixed: BestEffort and Guaranteed 1-CPU alternating; besteffort: no exclusive CPUs, "
                         "so no pool updates")
    ap.add_argument("--background", type=int, default=0, metavar="N",
                    help="N BestEffort pods (one running container each) kept alive on every daemon throughout: "
                         "each exclusive create and stop then moves N shared containers (pool updates measured)")
    ap.add_argument("--keep-log", type=Path, default=None, metavar="FILE",
                    help="copy the plugin's log (every answer's time breakdown, at debug level) to FILE")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crirm-nri-bench-"))
    try:
        with_plugin = start_containerd17(tmp / "with")
        plain = start_containerd17(tmp / "plain")
        null = start_containerd17(tmp / "null")
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
    kn = Kubelet(CriClient(null.socket), null.cgroup_parent, tmp / "logs-null")
    null_log = open(tmp / "null-plugin.log", "wb")  # noqa: SIM115 - closed in finally
    null_plugin = subprocess.Popen([sys.executable, str(Path(__file__).with_name("nri_null_plugin.py")),
                                    str(null.nri_socket)], stdout=subprocess.PIPE, stderr=null_log)
    daemons = (("with plugin", kw), ("without plugin", kp), ("null plugin", kn))
    try:
        plugin.start()
        assert null_plugin.stdout is not None
        if null_plugin.stdout.readline().strip() != b"registered":
            raise RuntimeError(f"null plugin failed: {(tmp / 'null-plugin.log').read_text()}")
        for _name, k in daemons:
            for j in range(args.background):
                bg = k.run_pod(PodSpec(f"background-{j}", qos="BestEffort"))
                k.run_container(bg, container_config("idle"))
        for i in range(4):  # warm-up: images, shims, caches
            for _name, k in daemons:
                lifecycle(k, i, args.pods)
        lat: dict[str, list[float]] = {name: [] for name, _k in daemons}
        cpu0, null_cpu0 = cpu_seconds(plugin.proc.pid), cpu_seconds(null_plugin.pid)
        machine0 = cpu_times()
        for i in range(args.lifecycles):
            # rotate which daemon goes first so that none always runs right after another
            for name, k in daemons[i % 3:] + daemons[:i % 3]:
                lat[name].append(lifecycle(k, i, args.pods))
        machine = [b - a for a, b in zip(machine0, cpu_times(), strict=True)]
        what = "BestEffort and Guaranteed 1-CPU alternating" if args.pods == "mixed" else "BestEffort only"
        if args.background:
            what += f"; {args.background} BestEffort pods running throughout"
        print(f"pod lifecycles x{args.lifecycles} per daemon ({what}), "
              f"{plugin.client().state().runtime or 'containerd 1.7'}; plugin state_dir "
              f"{plugin.config['state_dir']}")
        print(f"{'':>16} {'median ms':>10} {'p90 ms':>8}")
        for name, xs in lat.items():
            print(f"{name:>16} {statistics.median(xs) * 1e3:10.1f} {pct(xs, 0.9) * 1e3:8.1f}")
        for a, b, what in (("with plugin", "without plugin", "target <= 1.02"),
                           ("null plugin", "without plugin", "containerd's own NRI cost: no plugin avoids it"),
                           ("with plugin", "null plugin", "cri-resmgr's own cost")):
            ratio = statistics.median(lat[a]) / statistics.median(lat[b])
            paired = statistics.median(x / y for x, y in zip(lat[a], lat[b], strict=True))
            diff = statistics.median(x - y for x, y in zip(lat[a], lat[b], strict=True))
            print(f"{a} / {b}: ratio of medians {ratio:.3f}; median of paired ratios {paired:.3f}; "
                  f"median paired difference {diff * 1e3:+.1f} ms ({what})")
        cpu = cpu_seconds(plugin.proc.pid) - cpu0
        null_cpu = cpu_seconds(null_plugin.pid) - null_cpu0
        print(f"plugin process CPU time: {cpu * 1e3 / args.lifecycles:.1f} ms per lifecycle (all its threads: "
              f"hooks, cache persistence, reconcile); the null plugin's: {null_cpu * 1e3 / args.lifecycles:.1f} ms")
        total = sum(machine) or 1
        busy = (total - machine[3] - machine[4]) / total
        print(f"machine during the lifecycles (/proc/stat, all CPUs): busy {busy:.0%}, steal {machine[7] / total:.1%} "
              "(the hypervisor running something else on this VM's CPUs)")
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
        slow = slow_answers(plugin.log())
        print(f"\nanswers over 2 ms, where their time went (ms; the plugin's own trace), {len(slow)} of them")
        print(f"{'event':>18} {'wall':>6} {'cpu':>6} {'runq':>6} {'blocked':>7} {'steal':>6} {'others':>6} {'gc':>5} "
              "cause")
        for ev, wall, cpu_ms, runq, blocked, steal, others, gcs, cause in sorted(slow, key=lambda x: -x[1])[:20]:
            print(f"{ev:>18} {wall:6.2f} {cpu_ms:6.2f} {runq:6.2f} {blocked:7.2f} {steal:6.2f} {others:6.2f} "
                  f"{gcs:5.2f} {cause}")
        causes: dict[str, int] = {}
        for *_, cause in slow:
            causes[cause] = causes.get(cause, 0) + 1
        print("causes of answers over 2 ms:", ", ".join(f"{k} {v}" for k, v in sorted(causes.items())) or "none")
        print("plugin GC pauses (whole run):", gc_line(plugin.client().metrics()))
    finally:
        plugin.stop()
        if args.keep_log:
            shutil.copyfile(plugin.log_path, args.keep_log)
        null_plugin.terminate()
        try:
            null_plugin.wait(10)
        except subprocess.TimeoutExpired:
            null_plugin.kill()
            null_plugin.wait()
        null_log.close()
        for _name, k in daemons:
            k.cleanup()
            k.c.close()
        for c in (with_plugin, plain, null):
            problems = c.cleanup()
            if problems:
                print("cleanup problems:", problems, file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
