"""CRI relay against direct containerd, in the same run, calls interleaved.

Starts a private containerd (tests/integration/containerd.py), the relay (``cri-resmgr relay``, its own
process) and, as a baseline, a naive pass-through relay (a grpcio server forwarding each call with a grpcio
client). Then, with a few pods running so that ListContainers has something to say:

1. 2000 calls each of Version and ListContainers, direct / relay / naive interleaved: p50 and p99;
2. the same while the agent collects every 0.5 s and a separate process scrapes its /metrics every 0.1 s;
3. whole pod lifecycles (RunPodSandbox, CreateContainer, StartContainer, StopContainer, RemoveContainer,
   StopPodSandbox, RemovePodSandbox), direct, relay and direct again ("direct2", the A/A control: what the
   method reports for two identical targets) in alternating blocks (``--block``): median and p90, the median of
   the paired ratios (target / direct, same round) with a 95 % sign-test interval and a bootstrap one, per call
   the paired differences, and inside the relay where each call's time went (its Timings);
4. CreateContainer of a Guaranteed container (exclusive placement) whose pod carries 1,000 annotation entries
   (an affinity list naming 1,000 containers among them) with 500 containers in the relay's cache: relay,
   direct, and direct with the cpuset the relay writes ("direct+cpuset"), interleaved in rotating order, each
   create after a pause (``--settle-ms``) so that it meets an idle runtime (the previous create's pool updates
   done), each created container removed again: medians, p90, the paired (same round) differences, and where
   a create through the relay spends its time, point by point (the relay's time stamps, from its control
   socket's Timings call, set against the bench's own clock: both are CLOCK_MONOTONIC).

Needs root, containerd, runc and busybox-static (``make test`` installs them).

    .venv/bin/python bench/relay_bench.py [--calls 2000] [--lifecycles 30] [--block 1] [--phases 1,2,3,4]
        [--cache-containers 500] [--creates 30] [--settle-ms 150] [--relay-src DIR] [--no-naive] [--sched-trace]
        [--save FILE]

``--save FILE`` writes phase 3's lifecycles and phase 2's calls to FILE; ``bench/paired.py FILE...`` pools several
runs' pairs (each lifecycle paired with direct's in its own run) into one median and interval per target, and
``bench/paired.py --calls FILE...`` their calls under load into one p50 and p99 per target and method.

``--relay-src DIR`` (repeatable) adds, in phases 1 and 2, a relay run from another source tree (e.g.
``git archive 635e824 | tar -x -C /tmp/relay-old``) as target "alt1" ("alt2", ...), in front of the same
containerd and interleaved with the others in the same rounds, so that versions of the relay are compared on
the same machine at the same moment. In every round the targets take turns at going first.

``--sched-trace`` runs phase 2's Version calls under ``perf sched record`` (bench/sched_trace.py) and shows, for
the calls slower than direct's p99, how long the relay, the runtime and the client were runnable but waiting for
a CPU inside them, and which processes held those CPUs meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import _util  # noqa: F401  (puts the repo on sys.path)
import grpc
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pbg
from paired import RUN_FORMAT, bootstrap_interval, pct, sign_test_interval
from sched_trace import SchedTrace

from tests.integration.containerd import Containerd, missing_prerequisites
from tests.integration.cri import CriClient, Kubelet, PodSpec, RunningPod, container_config, guaranteed, pod_config
from tests.integration.helpers import AgentProcess
from tests.integration.relay.harness import RelayProcess

NAIVE = textwrap.dedent("""
    import sys, grpc
    from concurrent import futures
    up, path = sys.argv[1], sys.argv[2]
    ch = grpc.insecure_channel("unix://" + up)
    calls = {}
    class H(grpc.GenericRpcHandler):
        def service(self, d):
            c = calls.get(d.method) or calls.setdefault(d.method, ch.unary_unary(d.method))
            def fwd(req, ctx):
                t = ctx.time_remaining()
                return c(req, timeout=t if t is not None and t < 1e6 else None, metadata=ctx.invocation_metadata())
            return grpc.unary_unary_rpc_method_handler(fwd)
    s = grpc.server(futures.ThreadPoolExecutor(8))
    s.add_generic_rpc_handlers([H()])
    s.add_insecure_port("unix:" + path)
    s.start()
    print("ready", flush=True)
    s.wait_for_termination()
""")

SCRAPER = textwrap.dedent("""
    import sys, time, httpx
    url, until = sys.argv[1], time.time() + float(sys.argv[2])
    n = 0
    while time.time() < until:
        httpx.get(url, timeout=5); n += 1
        time.sleep(0.1)
    print(n)
""")


def interleaved(stubs: dict[str, object], call, n: int,
                marks: list[tuple[str, float, float]] | None = None) -> dict[str, list[float]]:
    """``n`` rounds of ``call`` on every target in rotating order: latencies per target (and, when ``marks`` is
    given, every call's (target, start, end) appended to it)."""
    lat: dict[str, list[float]] = {k: [] for k in stubs}
    for _ in range(20):
        for s in stubs.values():
            call(s)
    order = list(stubs.items())
    for i in range(n):
        r = i % len(order)
        for k, s in order[r:] + order[:r]:  # each target first, second, ... in turn
            t0 = time.perf_counter()
            call(s)
            t1 = time.perf_counter()
            lat[k].append(t1 - t0)
            if marks is not None:
                marks.append((k, t0, t1))
    return lat


def report(title: str, lat: dict[str, list[float]]) -> None:
    base50, base99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
    print(f"  {title}")
    for k, xs in lat.items():
        p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
        extra = "" if k == "direct" else \
            f"   added p50 {1e3 * (p50 - base50):+.3f} ms  p99 {1e3 * (p99 - base99):+.3f} ms"
        print(f"    {k:7s} p50 {1e3 * p50:7.3f} ms  p99 {1e3 * p99:7.3f} ms{extra}")
    r50, r99 = pct(lat["relay"], 0.5), pct(lat["relay"], 0.99)
    for k in (k for k in lat if k.startswith("alt")):
        a50, a99 = pct(lat[k], 0.5), pct(lat[k], 0.99)
        print(f"    relay - {k}: p50 {1e3 * (r50 - a50):+.3f} ms  p99 {1e3 * (r99 - a99):+.3f} ms")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (proc(5): fields 14 and 15, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def syscalls(pid: int) -> tuple[int, int]:
    """Read and write system calls a process made so far (proc(5), /proc/<pid>/io: syscr, syscw; read(2) and
    write(2) on its sockets count, which is what an event loop on libuv or selectors uses)."""
    with open(f"/proc/{pid}/io") as f:
        fields = dict(line.split(": ", 1) for line in f.read().splitlines())
    return int(fields["syscr"]), int(fields["syscw"])


def unary_rounds(stubs, n: int, trace: tuple[Path, dict[str, int], dict[str, int]] | None = None,
                 ) -> dict[str, dict[str, list[float]]]:
    """Version and ListContainers on every target: the latencies, method -> target -> seconds in round order.
    With ``trace`` (a directory, the pids of the groups whose waits count, and of other processes to name), the
    Version calls run under ``perf sched record`` and the slow ones' run-queue waits are shown."""
    version = pb.VersionRequest()
    lst = pb.ListContainersRequest()
    if trace is None:
        lat = interleaved(stubs, lambda s: s.Version(version, timeout=10), n)
        report(f"Version x{n}", lat)
    else:
        marks: list[tuple[str, float, float]] = []
        with SchedTrace(trace[0]) as tr:
            lat = interleaved(stubs, lambda s: s.Version(version, timeout=10), n, marks)
        report(f"Version x{n} (under perf sched record)", lat)
        slow = pct(lat["direct"], 0.99)
        print(f"    calls slower than direct's p99 ({1e3 * slow:.3f} ms): time runnable but waiting for a CPU, "
              "inside them, per group; and what held the CPUs they waited on")
        for target, (count, waited, ran) in tr.attribute(marks, trace[1], slow, trace[2]).items():
            print(f"      {target:7s} {count:4d} calls: waited " + ", ".join(
                f"{g} {1e3 * v / count:.2f}" for g, v in waited.most_common()) + " ms a call; CPUs held by "
                + ", ".join(f"{g} {1e3 * v / count:.2f}" for g, v in ran.most_common(4)) + " ms a call")
    listed = interleaved(stubs, lambda s: s.ListContainers(lst, timeout=10), n)
    report(f"ListContainers x{n}", listed)
    return {"Version": lat, "ListContainers": listed}


LIFECYCLE = ("RunPodSandbox", "CreateContainer", "StartContainer", "StopContainer", "RemoveContainer",
             "StopPodSandbox", "RemovePodSandbox")


def lifecycle(k: Kubelet, i: int) -> dict[str, float]:
    """One pod's whole life, as kubelet drives it: each call's time (client's view), by CRI method."""
    rt, timeout = k.c.runtime, k.c.timeout
    spec = PodSpec(f"bench-{i}")
    cfg = pod_config(spec, k.cgroup_parent_of(spec.qos, spec.uid), k.log_root / spec.uid)  # as Kubelet.run_pod
    times: dict[str, float] = {}

    def timed(method: str, call, req):
        t0 = time.perf_counter()
        r = call(req, timeout=timeout)
        times[method] = time.perf_counter() - t0
        return r

    pid = timed("RunPodSandbox", rt.RunPodSandbox, pb.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    pod = RunningPod(spec, pid, cfg)
    k.pods.append(pod)  # removed by cleanup if the bench fails half-way
    cid = timed("CreateContainer", rt.CreateContainer, pb.CreateContainerRequest(
        pod_sandbox_id=pid, config=container_config("app", cpu_milli_request=100), sandbox_config=cfg)).container_id
    timed("StartContainer", rt.StartContainer, pb.StartContainerRequest(container_id=cid))
    timed("StopContainer", rt.StopContainer, pb.StopContainerRequest(container_id=cid, timeout=2))
    timed("RemoveContainer", rt.RemoveContainer, pb.RemoveContainerRequest(container_id=cid))
    timed("StopPodSandbox", rt.StopPodSandbox, pb.StopPodSandboxRequest(pod_sandbox_id=pid))
    timed("RemovePodSandbox", rt.RemovePodSandbox, pb.RemovePodSandboxRequest(pod_sandbox_id=pid))
    k.pods.remove(pod)
    return times


def lifecycles(kubes: dict[str, Kubelet], n: int, block: int = 1) -> dict[str, list[dict[str, float]]]:
    """``n`` lifecycles per target, run as alternating blocks of ``block`` lifecycles (direct x block, relay x
    block, ...; the order rotated every round, so that each target follows each other one as often); per CRI
    method: each target's median, and each other target's paired difference from direct (the i-th lifecycle of a
    target's block against the i-th of direct's, same round). Returns each target's lifecycles, in order."""
    per: dict[str, list[dict[str, float]]] = {k: [] for k in kubes}
    order = list(kubes.items())
    j = 0
    for i in range(-(-n // block)):
        r = i % len(order)
        for k, kube in order[r:] + order[:r]:
            for _ in range(min(block, n - i * block)):
                per[k].append(lifecycle(kube, j))
                j += 1
    total = {k: [sum(t.values()) for t in ts] for k, ts in per.items()}
    d50 = statistics.median(total["direct"])
    for k, xs in total.items():
        m = statistics.median(xs)
        print(f"    {k:7s} median {1e3 * m:7.1f} ms  p90 {1e3 * pct(xs, 0.9):7.1f} ms"
              + ("" if k == "direct" else f"   {100 * (m - d50) / d50:+.1f}% vs direct"))
    others = [k for k in kubes if k != "direct"]
    print("    whole lifecycle, paired (same round, same place in the block): median of target / direct - 1, "
          "95 % interval (sign test; bootstrap)")
    for k in others:
        ratios = [a / b - 1 for a, b in zip(total[k], total["direct"], strict=True)]
        st, bs = sign_test_interval(ratios), bootstrap_interval(ratios)
        sign = "n/a" if st is None else f"[{100 * st.low:+.2f}, {100 * st.high:+.2f}] ({100 * st.coverage:.1f} %)"
        print(f"      {k:7s} {100 * statistics.median(ratios):+.2f} %  sign test {sign}; "
              f"bootstrap [{100 * bs.low:+.2f}, {100 * bs.high:+.2f}]  (n={len(ratios)})")
    for k in (k for k in kubes if k.startswith("alt")):  # relay trees against each other, paired the same way
        ratios = [a / b - 1 for a, b in zip(total["relay"], total[k], strict=True)]
        st = sign_test_interval(ratios)
        sign = "n/a" if st is None else f"[{100 * st.low:+.2f}, {100 * st.high:+.2f}]"
        print(f"      relay / {k} - 1: {100 * statistics.median(ratios):+.2f} %  sign test {sign}")
    print("    per call, ms: direct median; for each target: median, and target - direct paired median "
          "[p25, p75]")
    print("      " + f"{'':17s} {'direct':>7s}" + "".join(f" | {k:>7s} {'paired':>7s} {'[p25, p75]':>15s}"
                                                        for k in others))
    sums = dict.fromkeys(kubes, 0.0)
    for m in LIFECYCLE:
        med = {k: statistics.median(t[m] for t in ts) for k, ts in per.items()}
        for k in kubes:
            sums[k] += med[k]
        line = f"      {m:17s} {1e3 * med['direct']:7.2f}"
        for k in others:
            diffs = [a[m] - b[m] for a, b in zip(per[k], per["direct"], strict=True)]
            line += (f" | {1e3 * med[k]:7.2f} {1e3 * statistics.median(diffs):+7.2f} "
                     f"[{1e3 * pct(diffs, 0.25):+6.2f}, {1e3 * pct(diffs, 0.75):+6.2f}]")
        print(line)
    print(f"      {'sum of medians':17s} {1e3 * sums['direct']:7.2f}" + "".join(
        f" | {1e3 * sums[k]:7.2f} {100 * (sums[k] - sums['direct']) / sums['direct']:+6.1f}% {'':15s}"
        for k in others))
    return per


def save_run(path: Path, block: int, lifecycles: dict[str, list[dict[str, float]]] | None = None,
             calls: dict[str, dict[str, list[float]]] | None = None) -> None:
    """A run as bench/paired.py reads it, written whole or not at all: phase 3's lifecycles, each target's in the
    order run (the i-th of a target is paired with direct's i-th), each a dict of call -> seconds; phase 2's
    calls, method -> target -> seconds in round order (the i-th of every target from the same round)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, check=False, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):  # no git, or not a checkout: the run is saved without it
        head = ""
    doc = {"format": RUN_FORMAT, "commit": head, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "block": block}
    if lifecycles is not None:
        doc["lifecycles"] = lifecycles
    if calls is not None:
        doc["calls"] = calls
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


# Inside the relay, per lifecycle call (its Timings: every held or observed call), ms: from the read that brought
# the request to its last bytes handed to the runtime ("in"); from the runtime's response HEADERS to the answer's
# end handed to the client ("out": includes waiting for the runtime's trailers); the completion after it.
LEGS = (
    ("in: read -> forwarded", lambda t: t.forwarded - t.arrived),
    ("out: response -> answered", lambda t: t.answered - t.response),
    ("trailers -> answered", lambda t: t.answered - t.response_end),
    ("completion", lambda t: t.completed - t.answered),
)


def relay_legs(name: str, timings: dict[str, list]) -> None:
    print(f"    inside {name}, per call (median over its last lifecycles; ms): "
          + "; ".join(n for n, _f in LEGS))
    for m in LIFECYCLE:
        ts = [t for t in timings.get(m, []) if t.forwarded and t.answered]
        if not ts:
            continue
        print(f"      {m:17s} " + "  ".join(f"{1e3 * statistics.median(f(t) for t in ts):6.3f}" for _n, f in LEGS)
              + f"   (n={len(ts)})")


def crowded_creates(kd: Kubelet, kr: Kubelet, control, n_cached: int, n: int, settle: float) -> None:
    crowd = kr.run_pod(PodSpec("crowd", qos="BestEffort"))
    t0 = time.perf_counter()
    for i in range(n_cached):  # created, not started: in the relay's cache without a process each
        kr.create(crowd, container_config(f"c{i}"))
    print(f"    {n_cached} containers created through the relay in {time.perf_counter() - t0:.1f} s")
    ann = {f"example.com/key-{i}": f"value-{i}" for i in range(999)}
    ann["cri-resmgr.io/affinity"] = ",".join(f"crowd/c{i}" for i in range(1000))
    # "direct+cpuset": direct, with the cpuset the relay would write: what the runtime itself takes for it.
    pods = {"direct": (kd, kd.run_pod(PodSpec("annotated-d", qos="Guaranteed", annotations=ann))),
            "relay": (kr, kr.run_pod(PodSpec("annotated-r", qos="Guaranteed", annotations=ann))),
            "direct+cpuset": (kd, kd.run_pod(PodSpec("annotated-c", qos="Guaranteed", annotations=ann)))}
    lat: dict[str, list[float]] = {k: [] for k in pods}
    spans: list[tuple[float, float]] = []  # the relay's creates as the client saw them (perf_counter)
    order = list(pods)
    warm = 3
    for i in range(n + warm):
        for k in order[i % 3:] + order[:i % 3]:  # each target first, second and third in turn
            kube, pod = pods[k]
            cfg = guaranteed(f"g{i}", 1000)
            if k == "direct+cpuset":
                cfg.linux.resources.cpuset_cpus, cfg.linux.resources.cpuset_mems = "1", "0"
            time.sleep(settle)  # the previous create's and remove's after-effects (pool updates) are over
            t0 = time.perf_counter()
            cid = kube.create(pod, cfg)
            t1 = time.perf_counter()
            dt = t1 - t0
            kube.c.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=cid), timeout=30)
            pod.containers.pop(cfg.metadata.name, None)
            if i >= warm:
                lat[k].append(dt)
                if k == "relay":
                    spans.append((t0, t1))
    d50 = statistics.median(lat["direct"])
    for k, xs in lat.items():
        m = statistics.median(xs)
        print(f"    {k:13s} median {1e3 * m:7.2f} ms  p90 {1e3 * pct(xs, 0.9):7.2f} ms"
              + ("" if k == "direct" else f"   {1e3 * (m - d50):+.2f} ms vs direct (medians)"))
    for base in ("direct", "direct+cpuset"):
        diffs = [r - b for r, b in zip(lat["relay"], lat[base], strict=True)]
        print(f"    relay - {base:13s} paired (same round): median {1e3 * statistics.median(diffs):+.2f} ms  "
              f"p25 {1e3 * pct(diffs, 0.25):+.2f}  p75 {1e3 * pct(diffs, 0.75):+.2f} ms")
    where_the_time_goes(spans, control.rewrite_timings().get("CreateContainer", []), lat["direct"])


# A create through the relay, point by point: the client's clock and the relay's are both CLOCK_MONOTONIC
# (time.perf_counter on Linux), so the relay's time stamps (control socket: Timings) fall inside the client's span.
SEGMENTS = (
    ("client sends -> relay reads it", lambda c0, t, c1: t.arrived - c0),
    ("read -> HEADERS parsed (HPACK)", lambda c0, t, c1: t.headers - t.arrived),
    ("HEADERS -> request complete (45 kB in)", lambda c0, t, c1: t.held - t.headers),
    ("waiting for the hook", lambda c0, t, c1: t.started - t.held),
    ("rewrite hook", lambda c0, t, c1: t.returned - t.started),
    ("hook -> handed to runtime socket", lambda c0, t, c1: t.forwarded - t.returned),
    ("runtime: forwarded -> response HEADERS", lambda c0, t, c1: t.response - t.forwarded),
    ("response HEADERS -> trailers", lambda c0, t, c1: t.response_end - t.response),
    ("trailers -> answer handed to client socket", lambda c0, t, c1: t.answered - t.response_end),
    ("answer handed -> client returns", lambda c0, t, c1: c1 - t.answered),
    ("(after the answer: completion hook)", lambda c0, t, c1: t.completed - t.answered),
)


def where_the_time_goes(spans: list[tuple[float, float]], timings: list, direct: list[float]) -> None:
    matched = []
    for c0, c1 in spans:
        t = next((t for t in timings if c0 <= t.headers <= c1), None)
        if t is not None and t.answered:
            matched.append((c0, t, c1))
    if not matched:
        print("    (no relay time stamps matched the creates)")
        return
    print(f"    a create through the relay, point by point (median over {len(matched)} creates; "
          f"ms; p25 / p75):")
    for name, f in SEGMENTS:
        xs = [f(*m) for m in matched]
        print(f"      {name:46s} {1e3 * statistics.median(xs):7.3f}   {1e3 * pct(xs, 0.25):7.3f} / "
              f"{1e3 * pct(xs, 0.75):7.3f}")
    outside = [(t.arrived - c0) + (c1 - t.answered) for c0, t, c1 in matched]
    inside = [(t.forwarded - t.arrived) + (t.answered - t.response) for c0, t, c1 in matched]  # on the path
    runtime = [t.response - t.forwarded for c0, t, c1 in matched]
    print(f"      relay's own (before forward + after response) {1e3 * statistics.median(inside):7.3f} ms; "
          f"client<->relay hops {1e3 * statistics.median(outside):.3f} ms; runtime leg "
          f"{1e3 * statistics.median(runtime):.2f} ms vs direct create {1e3 * statistics.median(direct):.2f} ms")
    reads = [t.reads for _c0, t, _c1 in matched]
    buffered = [t.upstream_buffered for _c0, t, _c1 in matched]
    print(f"      client reads per request: median {statistics.median(reads):g}, max {max(reads)}; "
          f"bytes the runtime's socket did not take at once: max {max(buffered)}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--lifecycles", type=int, default=30)
    ap.add_argument("--phases", default="1,2,3,4", help="which of the phases above to run")
    ap.add_argument("--block", type=int, default=1,
                    help="phase 3: lifecycles a target runs in a row before the next target's turn")
    ap.add_argument("--cache-containers", type=int, default=500)
    ap.add_argument("--creates", type=int, default=30)
    ap.add_argument("--settle-ms", type=float, default=150.0,
                    help="phase 4: pause before each create, so that each meets an idle runtime and relay")
    ap.add_argument("--relay-src", type=Path, action="append", default=[],
                    help="phases 1-3: also a relay run from this source tree (targets alt1, alt2, ...), interleaved")
    ap.add_argument("--no-naive", action="store_true", help="phases 1-2: leave out the naive grpcio relay")
    ap.add_argument("--save", type=Path, metavar="FILE",
                    help="phases 2 and 3: write each target's calls under load and its lifecycles (per call, in "
                         "order) to FILE as JSON, so that runs can be pooled (bench/paired.py [--calls] FILE...)")
    ap.add_argument("--sched-trace", action="store_true",
                    help="phase 2: record the scheduler's events (perf sched) during the Version calls and show, for "
                         "the calls slower than direct's p99, who waited for a CPU and who held it")
    args = ap.parse_args()
    phases = {int(x) for x in args.phases.split(",") if x}
    reason = missing_prerequisites()
    if reason:
        print(f"relay_bench: skipped: {reason}")
        return 0
    base = Path(tempfile.mkdtemp(prefix="crirm-bench-"))
    cd = Containerd(base / "cd")
    procs: list[subprocess.Popen] = []
    relay = agent = None
    alts: list[RelayProcess] = []
    kubes: list[Kubelet] = []
    try:
        cd.start()
        cd.import_images()
        # The relay as deployed: the default reconcile interval (the test harness reconciles every 0.5 s).
        relay = RelayProcess(base / "relay", cd.socket, {"relay": {"reconcile_interval_seconds": 5.0}}).start()
        targets = {"direct": cd.socket, "relay": relay.socket}
        if not args.no_naive:
            naive_sock = base / "naive.sock"
            naive = subprocess.Popen([sys.executable, "-c", NAIVE, str(cd.socket), str(naive_sock)],
                                     stdout=subprocess.PIPE, text=True)
            procs.append(naive)
            naive.stdout.readline()
            targets["naive"] = naive_sock
        for i, src in enumerate(args.relay_src, 1):
            alts.append(RelayProcess(base / f"relay-alt{i}", cd.socket, {"relay": {"reconcile_interval_seconds": 5.0}},
                                     src=src).start())
            targets[f"alt{i}"] = alts[-1].socket
        chans = {k: grpc.insecure_channel(f"unix://{p}") for k, p in targets.items()}
        stubs = {k: pbg.RuntimeServiceStub(c) for k, c in chans.items()}

        bg = Kubelet(CriClient(cd.socket), cd.cgroup_parent, base / "logs")
        kubes.append(bg)
        for i in range(5):
            bg.run_container(bg.run_pod(PodSpec(f"background-{i}")), container_config("app", cpu_milli_request=50))

        print(f"relay bench: containerd {bg.c.runtime.Version(pb.VersionRequest()).runtime_version}, "
              f"5 pods running, {args.calls} calls per target, interleaved ({', '.join(targets)})"
              + "".join(f"; alt{i} = relay from {src}" for i, src in enumerate(args.relay_src, 1)))
        if 1 in phases:
            print("1. idle node")
            unary_rounds(stubs, args.calls)

        saved: dict[str, dict] = {}
        if 2 in phases:
            print("2. agent collecting every 0.5 s, /metrics scraped every 0.1 s by another process")
            (base / "agent").mkdir()
            agent = AgentProcess(base / "agent").start()
            scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, agent.url + "/metrics", "600"],
                                       stdout=subprocess.PIPE, text=True)
            procs.append(scraper)
            load = {"agent": agent.proc.pid, "scraper": scraper.pid, "relay": relay.proc.pid}
            before, t0 = {k: cpu_seconds(p) for k, p in load.items()}, time.perf_counter()
            trace = None
            if args.sched_trace:
                why = SchedTrace.missing()
                if why:
                    print(f"  --sched-trace: {why}")
                else:
                    trace = (base, {"relay": relay.proc.pid, "runtime": cd.proc.pid, "client": os.getpid(),
                                    **{f"alt{i}": a.proc.pid for i, a in enumerate(alts, 1)}},
                             {"agent": agent.proc.pid, "scraper": scraper.pid})
            saved["calls"] = unary_rounds(stubs, args.calls, trace)
            if args.save is not None:
                save_run(args.save, args.block, **saved)
                print(f"  calls saved to {args.save} (pool runs: .venv/bin/python bench/paired.py --calls FILE...)")
            wall = time.perf_counter() - t0
            print("  CPU used during phase 2, share of one CPU: " + ", ".join(
                f"{k} {100 * (cpu_seconds(p) - before[k]) / wall:.0f}%" for k, p in load.items()))
            scraper.terminate()

        kd = Kubelet(CriClient(cd.socket), cd.cgroup_parent, base / "logs")
        kr = Kubelet(CriClient(relay.socket), cd.cgroup_parent, base / "logs")
        alt_kubes = {f"alt{i}": Kubelet(CriClient(a.socket), cd.cgroup_parent, base / "logs")
                     for i, a in enumerate(alts, 1)}
        kubes += [kd, kr, *alt_kubes.values()]
        if 3 in phases:
            # "direct2": direct again, as a target of its own: the A/A control, the noise floor of the method.
            kd2 = Kubelet(CriClient(cd.socket), cd.cgroup_parent, base / "logs")
            kubes.append(kd2)
            print(f"3. pod lifecycles x{args.lifecycles} per target in blocks of {args.block} "
                  "(run pod, create, start, stop, remove container, stop, remove pod)")
            relays = {"relay": relay, **{f"alt{i}": a for i, a in enumerate(alts, 1)}}
            cpu0 = {k: cpu_seconds(r.proc.pid) for k, r in relays.items()}
            io0 = {k: syscalls(r.proc.pid) for k, r in relays.items()}
            per = lifecycles({"direct": kd, "relay": kr, "direct2": kd2, **alt_kubes}, args.lifecycles, args.block)
            saved["lifecycles"] = per
            if args.save is not None:
                save_run(args.save, args.block, **saved)
                print(f"    lifecycles saved to {args.save} (pool runs: .venv/bin/python bench/paired.py FILE...)")
            print("    per lifecycle, each relay (all its threads, background work included): CPU (user + system); "
                  "read and write system calls (7 calls need at least 14 of each)")
            for k, r in relays.items():
                reads, writes = (b - a for a, b in zip(io0[k], syscalls(r.proc.pid), strict=True))
                print(f"      {k:7s} {1e3 * (cpu_seconds(r.proc.pid) - cpu0[k]) / args.lifecycles:.2f} ms CPU, "
                      f"{reads / args.lifecycles:.1f} reads, {writes / args.lifecycles:.1f} writes")
            for name, proc in relays.items():
                control = proc.client()
                try:
                    relay_legs(name, control.rewrite_timings())
                finally:
                    control.close()

        if 4 in phases:
            print(f"4. CreateContainer x{args.creates}, Guaranteed, pod with 1,000 annotation entries, "
                  f"{args.cache_containers} containers in the relay's cache")
            control = relay.client()
            try:
                crowded_creates(kd, kr, control, args.cache_containers, args.creates, args.settle_ms / 1e3)
            finally:
                control.close()
        for c in chans.values():
            c.close()
    finally:
        for k in kubes:
            k.cleanup()
        if agent is not None:
            agent.stop()
        if relay is not None:
            relay.stop()
        for a in alts:
            a.stop()
        for p in procs:
            p.kill()
            p.wait()
        problems = cd.cleanup()
        if problems:
            print("cleanup problems:", problems, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
