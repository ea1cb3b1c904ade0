"""AVX-512 collector for real: an AVX-512 loop, a scalar loop and a pure-Python loop, each in its own real
cgroup, counted by the real eBPF program on this kernel and read back from the running agent's /metrics.

The C loops (tests/integration/workloads/*.c) are compiled here with gcc; the BPF object is the one
`make bpf` builds (built by the loader tests' fixture when missing and clang is present)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cri_resmgr.collectors.avx512 import Avx512Collector
from cri_resmgr.config import Avx512CollectorConfig, Paths
from cri_resmgr.ebpf.avx512 import DEFAULT_OBJECT
from cri_resmgr.ebpf.probe import probe_capabilities
from cri_resmgr.topology import discover

from .helpers import AgentProcess, RealCgroup, can_make_cgroups, wait_for
from .test_nonroot import REPO, NobodyAgent, nobody_python, open_tmp  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

WORKLOADS = Path(__file__).resolve().parent / "workloads"
RUN_SECONDS = 90  # upper bound; every workload is killed at teardown
PY_LOOP = ("import time\nend = time.time() + float(__import__('sys').argv[1])\nx = 0\n"
           "while time.time() < end:\n x += 1\n")


def samples(text: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def value(text: str, name: str, **labels) -> float | None:
    for s in samples(text, name):
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


@pytest.fixture(scope="module")
def avx512_host():
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    if not DEFAULT_OBJECT.exists():
        if not shutil.which("clang"):
            pytest.skip("BPF object not built and clang missing (apt: clang libbpf-dev; make bpf)")
        subprocess.run(["make", "--no-print-directory", "bpf"], cwd=REPO, check=True)
    r = probe_capabilities(Path("/sys"), Path("/proc"), DEFAULT_OBJECT, Path("/lib/modules"))
    problems = r.common() + r.libbpf_problems()
    if problems:
        pytest.skip("; ".join(problems))


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    if not shutil.which("gcc"):
        pytest.skip("gcc not installed")
    d = tmp_path_factory.mktemp("avx512-workloads")
    subprocess.run(["gcc", "-O2", "-mavx512f", "-o", d / "avx512_loop", WORKLOADS / "avx512_loop.c"], check=True)
    subprocess.run(["gcc", "-O2", "-mno-avx", "-o", d / "scalar_loop", WORKLOADS / "scalar_loop.c"], check=True)
    return d


class Workload:
    """A process in its own real cgroup; ``cpu`` pins it there (after joining the cgroup: a v1 cpuset attach
    resets the affinity), so that workloads sharing a CPU must take turns and switch context predictably."""

    def __init__(self, argv: list[str], cgroup: RealCgroup, cpu: int | None = None):
        self.cgroup = cgroup.create()
        self.proc = subprocess.Popen(argv)
        try:
            cgroup.add(self.proc.pid)
            if cpu is not None:
                os.sched_setaffinity(self.proc.pid, {cpu})
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.cgroup.remove()


@pytest.fixture
def three_loops(avx512_host, binaries):
    started: dict[str, Workload] = {}
    cpu = min(os.sched_getaffinity(0))  # one CPU: the loops take turns, so each switches context often
    try:
        for name, argv in (("avx512", [str(binaries / "avx512_loop"), str(RUN_SECONDS)]),
                           ("scalar", [str(binaries / "scalar_loop"), str(RUN_SECONDS)]),
                           ("python", [sys.executable, "-c", PY_LOOP, str(RUN_SECONDS)])):
            started[name] = Workload(argv, RealCgroup(), cpu)
        yield started
    finally:
        for w in started.values():
            w.stop()


def test_agent_reports_avx512_only_for_the_avx512_loop(tmp_path, three_loops):
    window = 3.0
    agent = AgentProcess(tmp_path, {"collectors": {"avx512": {"interval_seconds": 0.5, "window_seconds": window}}})
    agent.start()
    try:
        ids = {n: w.cgroup.container_id for n, w in three_loops.items()}

        def enough_switches():
            text = agent.get("/metrics")
            vals = [value(text, "cri_resmgr_container_context_switches_total", container_id=c) for c in ids.values()]
            return all(v is not None and v >= 30 for v in vals)

        wait_for(enough_switches, timeout=30, what="context switches of the three loops in /metrics")
        time.sleep(window + 1.0)  # a full window of samples after the first switches
        text = agent.get("/metrics")
        got = {n: {m: value(text, f"cri_resmgr_container_{m}", container_id=c)
                   for m in ("avx512_ratio", "avx512_active", "avx512_switches_total", "context_switches_total",
                             "avx512_last_use_timestamp_seconds")}
               for n, c in ids.items()}
        assert got["avx512"]["avx512_ratio"] >= 0.5, got
        assert got["avx512"]["avx512_active"] == 1.0, got
        assert got["avx512"]["avx512_switches_total"] >= 15, got
        assert time.time() - got["avx512"]["avx512_last_use_timestamp_seconds"] < 5, got
        for n in ("scalar", "python"):
            assert got[n]["avx512_ratio"] <= 0.05, (n, got)
            assert got[n]["avx512_active"] == 0.0, (n, got)
            assert got[n]["context_switches_total"] >= 30, (n, got)
        # container labels come from the cgroup path, as for the cgroup collector
        pod = three_loops["avx512"].cgroup.pod_uid
        assert any(s.labels.get("pod_uid") == pod and s.labels.get("qos_class") == "Burstable"
                   for s in samples(text, "cri_resmgr_container_avx512_ratio"))
        # per CPU, with topology labels; the CPUs together saw at least the AVX-512 loop's switches
        per_cpu = samples(text, "cri_resmgr_cpu_avx512_switches_total")
        assert per_cpu and all({"cpu", "core", "die", "numa_node", "package"} <= set(s.labels) for s in per_cpu)
        assert sum(s.value for s in per_cpu) >= got["avx512"]["avx512_switches_total"]
        assert value(text, "cri_resmgr_collector_up", collector="avx512") == 1.0
        assert value(text, "cri_resmgr_avx512_map_insert_failures_total") == 0.0
        col = {c["name"]: c for c in agent.get("/api/v1/collectors")}["avx512"]
        assert col["up"] and col["reason"] == "libbpf; attribution by cgroup_id", col
        # the rest of the API sees the same series from the store
        now = time.time()
        qr = agent.get("/api/v1/query_range", metric="cri_resmgr_container_avx512_ratio",
                       **{"match[]": f'{{container_id="{ids["avx512"]}"}}'}, start=now - 2, end=now, step=1)
        assert max(v for v in qr["series"][0]["values"] if v is not None) >= 0.5, qr
    finally:
        assert agent.stop() == 0


def test_pid_attribution_on_v1_cgroups_keeps_counters_monotonic(avx512_host, binaries):
    """v1-only attribution (per process, /proc/<pid>/cgroup), exercised on this host's real v1 hierarchy with
    the containers kept out of the v2 tree; then the AVX-512 process exits and its counts must stay.

    Both loops are pinned to one CPU so that they take turns: two busy loops on two otherwise idle CPUs may
    run for seconds without a single context switch, and a switch is what the collector counts."""
    paths = Paths()
    cfg = Avx512CollectorConfig(interval_seconds=0.5, window_seconds=2.0, attribution="pid", map_entries=4096)
    col = Avx512Collector(cfg, paths, discover(paths.sysfs))
    cpu = min(os.sched_getaffinity(0))
    avx = scalar = None
    try:
        probe = col.probe()
        assert probe.ok and probe.reason == "libbpf; attribution by pid", probe
        avx = Workload([str(binaries / "avx512_loop"), str(RUN_SECONDS)], RealCgroup(unified=False), cpu)
        scalar = Workload([str(binaries / "scalar_loop"), str(RUN_SECONDS)], RealCgroup(unified=False), cpu)
        cid_avx, cid_scalar = avx.cgroup.container_id, scalar.cgroup.container_id

        def by_container(ss, metric):
            return {s.labels["container_id"]: s.value for s in ss if s.metric == metric}

        deadline = time.time() + 20
        while True:
            ss = col.collect(time.time())
            sw = by_container(ss, "cri_resmgr_container_context_switches_total")
            if sw.get(cid_avx, 0) >= 30 and sw.get(cid_scalar, 0) >= 30:
                break
            assert time.time() < deadline, f"fewer than 30 context switches in 20 s: {sw}"
            time.sleep(0.5)
        time.sleep(cfg.window_seconds)  # a full window of samples with both loops taking turns
        ss = col.collect(time.time())
        ratio = by_container(ss, "cri_resmgr_container_avx512_ratio")
        assert ratio[cid_avx] >= 0.5 and ratio[cid_scalar] <= 0.05, (ratio, sw)
        before = by_container(ss, "cri_resmgr_container_avx512_switches_total")[cid_avx]
        pid = avx.proc.pid
        assert any(k.tgid == pid for k in col.source.read().counts)
        avx.proc.terminate()  # the process exits; its cgroup stays
        avx.proc.wait(10)
        ss = col.collect(time.time())
        assert not any(k.tgid == pid for k in col.source.read().counts)  # retired from the map
        after = by_container(ss, "cri_resmgr_container_avx512_switches_total")[cid_avx]
        assert after >= before > 0  # the exited process's counts were kept for its container
    finally:
        for w in (avx, scalar):
            if w is not None:
                w.stop()
        col.close()


def test_agent_without_root_reports_avx512_down_with_reason(open_tmp, nobody_python):  # noqa: F811
    agent = NobodyAgent(open_tmp, nobody_python, {"collectors": {"avx512": {"interval_seconds": 0.5}}})
    try:
        agent.wait_ready()
        col = {c["name"]: c for c in httpx.get(agent.url + "/api/v1/collectors").json()}["avx512"]
        assert col["enabled"] and not col["up"], col
        assert "not root and no CAP_BPF+CAP_PERFMON or CAP_SYS_ADMIN" in col["reason"], col
        text = httpx.get(agent.url + "/metrics").text
        assert value(text, "cri_resmgr_collector_up", collector="avx512") == 0.0
        assert value(text, "cri_resmgr_collector_up", collector="cpu") == 1.0  # the rest keeps working
    finally:
        assert agent.stop() == 0
