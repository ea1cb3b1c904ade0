"""CRI relay against direct containerd, in the same run, calls interleaved.

Starts a private containerd (tests/integration/containerd.py), the relay (``cri-resmgr relay``, its own
process) and, as a baseline, a naive pass-through relay (a grpcio server forwarding each call with a grpcio
client). Then, with a few pods running so that ListContainers has something to say:

1. 2000 calls each of Version and ListContainers, direct / relay / naive interleaved: p50 and p99;
2. the same while the agent collects every 0.5 s and a separate process scrapes its /metrics every 0.1 s;
3. whole pod lifecycles (RunPodSandbox, CreateContainer, StartContainer, StopContainer, RemoveContainer,
   StopPodSandbox, RemovePodSandbox), direct and relay interleaved: median and p90.

Needs root, containerd, runc and busybox-static (``make test`` installs them).

    .venv/bin/python bench/relay_bench.py [--calls 2000] [--lifecycles 30]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import _util  # noqa: F401  (puts the repo on sys.path)

import grpc  # noqa: E402
from cri_api.v1 import api_pb2 as pb  # noqa: E402
from cri_api.v1 import api_pb2_grpc as pbg  # noqa: E402

from tests.integration.containerd import Containerd, missing_prerequisites  # noqa: E402
from tests.integration.cri import CriClient, Kubelet, PodSpec, container_config  # noqa: E402
from tests.integration.helpers import AgentProcess  # noqa: E402
from tests.integration.relay.harness import RelayProcess  # noqa: E402

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


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def interleaved(stubs: dict[str, object], call, n: int) -> dict[str, list[float]]:
    lat = {k: [] for k in stubs}
    for _ in range(20):
        for s in stubs.values():
            call(s)
    for _ in range(n):
        for k, s in stubs.items():
            t0 = time.perf_counter()
            call(s)
            lat[k].append(time.perf_counter() - t0)
    return lat


def report(title: str, lat: dict[str, list[float]]) -> None:
    base50, base99 = pct(lat["direct"], 0.5), pct(lat["direct"], 0.99)
    print(f"  {title}")
    for k, xs in lat.items():
        p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
        extra = "" if k == "direct" else f"   added p50 {1e3 * (p50 - base50):+.3f} ms  p99 {1e3 * (p99 - base99):+.3f} ms"
        print(f"    {k:7s} p50 {1e3 * p50:7.3f} ms  p99 {1e3 * p99:7.3f} ms{extra}")


def unary_rounds(stubs, n: int) -> None:
    version = pb.VersionRequest()
    lst = pb.ListContainersRequest()
    report(f"Version x{n}", interleaved(stubs, lambda s: s.Version(version, timeout=10), n))
    report(f"ListContainers x{n}", interleaved(stubs, lambda s: s.ListContainers(lst, timeout=10), n))


def lifecycle(k: Kubelet, i: int) -> float:
    t0 = time.perf_counter()
    pod = k.run_pod(PodSpec(f"bench-{i}"))
    cid = k.run_container(pod, container_config("app", cpu_milli_request=100))
    k.stop_remove_container(cid)
    pod.containers.clear()
    k.stop_remove_pod(pod)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--lifecycles", type=int, default=30)
    args = ap.parse_args()
    reason = missing_prerequisites()
    if reason:
        print(f"relay_bench: skipped: {reason}")
        return 0
    base = Path(tempfile.mkdtemp(prefix="crirm-bench-"))
    cd = Containerd(base / "cd")
    procs: list[subprocess.Popen] = []
    relay = agent = None
    kubes: list[Kubelet] = []
    try:
        cd.start()
        cd.import_images()
        relay = RelayProcess(base / "relay", cd.socket).start()
        naive_sock = base / "naive.sock"
        naive = subprocess.Popen([sys.executable, "-c", NAIVE, str(cd.socket), str(naive_sock)],
                                 stdout=subprocess.PIPE, text=True)
        procs.append(naive)
        naive.stdout.readline()
        targets = {"direct": cd.socket, "relay": relay.socket, "naive": naive_sock}
        chans = {k: grpc.insecure_channel(f"unix://{p}") for k, p in targets.items()}
        stubs = {k: pbg.RuntimeServiceStub(c) for k, c in chans.items()}

        bg = Kubelet(CriClient(cd.socket), cd.cgroup_parent, base / "logs")
        kubes.append(bg)
        for i in range(5):
            bg.run_container(bg.run_pod(PodSpec(f"background-{i}")), container_config("app", cpu_milli_request=50))

        print(f"relay bench: containerd {bg.c.runtime.Version(pb.VersionRequest()).runtime_version}, "
              f"5 pods running, {args.calls} calls per target, interleaved (direct, relay, naive grpcio relay)")
        print("1. idle node")
        unary_rounds(stubs, args.calls)

        print("2. agent collecting every 0.5 s, /metrics scraped every 0.1 s by another process")
        (base / "agent").mkdir()
        agent = AgentProcess(base / "agent").start()
        scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, agent.url + "/metrics", "600"],
                                   stdout=subprocess.PIPE, text=True)
        procs.append(scraper)
        unary_rounds(stubs, args.calls)
        scraper.terminate()

        print(f"3. pod lifecycles x{args.lifecycles} (run pod, create, start, stop, remove container, stop, remove pod)")
        kd = Kubelet(CriClient(cd.socket), cd.cgroup_parent, base / "logs")
        kr = Kubelet(CriClient(relay.socket), cd.cgroup_parent, base / "logs")
        kubes += [kd, kr]
        lat = {"direct": [], "relay": []}
        for i in range(args.lifecycles):
            lat["direct"].append(lifecycle(kd, 2 * i))
            lat["relay"].append(lifecycle(kr, 2 * i + 1))
        d50 = statistics.median(lat["direct"])
        for k, xs in lat.items():
            m = statistics.median(xs)
            print(f"    {k:7s} median {1e3 * m:7.1f} ms  p90 {1e3 * pct(xs, 0.9):7.1f} ms"
                  + ("" if k == "direct" else f"   {100 * (m - d50) / d50:+.1f}% vs direct"))
        for c in chans.values():
            c.close()
    finally:
        for k in kubes:
            k.cleanup()
        if agent is not None:
            agent.stop()
        if relay is not None:
            relay.stop()
        for p in procs:
            p.kill()
            p.wait()
        problems = cd.cleanup()
        if problems:
            print("cleanup problems:", problems, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
