"""The rebalancer in enforce mode, for real: the agent subprocess moves real cgroups' cpusets.

Two AVX512 and two scalar workloads in four real cgroups (cgroup v1 cpuset here) all start on every
CPU. The agent's rebalancer (mode enforce, applier cgroup) must put the AVX512 pair on CPUs disjoint
from the scalar pair within a few rounds — checked in the cgroups' own cpuset files — and make no move
in five rounds after that.

The AVX512 ratio comes from ``rebalancer.overrides`` (the model input), not from the AVX512 collector:
that is issue #3's signal, and this test is about the rebalancer acting on it. The AVX512 workload is
real AVX-512 code when a C compiler and an AVX-512 CPU are present (a scalar loop otherwise).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cri_resmgr.sysfs import parse_cpulist

from .helpers import AgentProcess, RealCgroup, can_make_cgroups, wait_for

pytestmark = pytest.mark.integration

# ~50% duty cycle: the node stays usable for others while the cgroups still show CPU use.
SCALAR = "import time\nwhile True:\n    t = time.time()\n    while time.time() - t < 0.01: pass\n    time.sleep(0.01)\n"
AVX512_C = r"""
#include <immintrin.h>
#include <time.h>
int main(void) {
    __m512d a = _mm512_set1_pd(1.0000001), b = _mm512_set1_pd(0.9999999), c = _mm512_set1_pd(0.0);
    struct timespec nap = {0, 10 * 1000 * 1000}, t0, t;
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do {
            for (int i = 0; i < 1000; i++) c = _mm512_fmadd_pd(a, b, c);
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while ((t.tv_sec - t0.tv_sec) * 1000000000L + (t.tv_nsec - t0.tv_nsec) < 10000000L);
        if (_mm512_reduce_add_pd(c) == 42.0) return 1;  /* keep the loop alive */
        nanosleep(&nap, 0);
    }
}
"""


def _avx512_command(tmp: Path) -> list[str]:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if cc and " avx512f" in flags:
        src, exe = tmp / "avx512loop.c", tmp / "avx512loop"
        src.write_text(AVX512_C)
        if subprocess.run([cc, "-O2", "-mavx512f", "-o", str(exe), str(src)], capture_output=True).returncode == 0:
            return [str(exe)]
    return [sys.executable, "-c", SCALAR]


def _cpuset(cg: RealCgroup) -> frozenset[int]:
    return parse_cpulist((cg.layout.cpuset / cg.rel / "cpuset.cpus").read_text())


@pytest.fixture
def workloads(tmp_path):
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    cgs: dict[str, RealCgroup] = {}
    procs: list[subprocess.Popen] = []
    base = f"cri-resmgr-test-rebalancer-{uuid.uuid4().hex[:8]}"
    try:
        probe = RealCgroup()
        if probe.layout.version != 1 or probe.layout.cpuset is None:
            pytest.skip("needs the cgroup v1 cpuset controller (this test writes cpuset/<cgroup>/cpuset.cpus)")
        online = parse_cpulist((probe.layout.cpuset / "cpuset.cpus").read_text())
        if len(online) < 2:
            pytest.skip("needs at least 2 CPUs")
        avx = _avx512_command(tmp_path)
        for name in ("avx-a", "avx-b", "scalar-a", "scalar-b"):
            cg = RealCgroup()
            cg.rel = f"{base}/{name}"
            cg.create()
            cgs[name] = cg
            p = subprocess.Popen(avx if name.startswith("avx") else [sys.executable, "-c", SCALAR])
            procs.append(p)
            cg.add(p.pid)
        yield base, cgs, online, avx
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for cg in reversed(list(cgs.values())):
            cg.remove()
        for root in (probe.layout.cpuacct, probe.layout.cpu, probe.layout.memory, probe.layout.cpuset,
                     probe.layout.unified):
            if root is not None and (root / base).is_dir():
                with contextlib.suppress(OSError):  # still busy: the next run's set-up reports it
                    (root / base).rmdir()


def test_enforce_separates_avx512_from_scalar_cgroups_and_then_stays(tmp_path, workloads):
    base, cgs, online, avx = workloads
    ns = f"rebalancer-e2e-{uuid.uuid4().hex[:6]}"
    assert all(_cpuset(cg) == online for cg in cgs.values())
    agent = AgentProcess(tmp_path, {
        "api": {"token": "t0ken"},
        "collectors": {"cgroup": {"interval_seconds": 0.5, "extra_cgroups": [
            {"name": n, "path": f"{base}/{n}", "namespace": ns, "pod": n} for n in cgs]}},
        "rebalancer": {
            "mode": "enforce", "applier": "cgroup", "interval_seconds": 1.0, "window_seconds": 3.0,
            "cooldown_seconds": 0, "namespaces": [ns],
            # Every round plans (a round whose inputs did not change is otherwise skipped, unrecorded): the five
            # rounds after the settling below are planned rounds that must each leave the placement alone.
            "skip_threshold": 0,
            # Half-duty loops on a shared 2-CPU node show ~0.1-0.5 CPU each: with the default 60 s
            # amortization such small containers are not worth four moves. Ten minutes make them worth it.
            "amortization_seconds": 600, "migration": {"disruption": 0.2},
            "overrides": [{"match": {"namespace": ns, "container": "avx-a"}, "avx512_ratio": 1.0},
                          {"match": {"namespace": ns, "container": "avx-b"}, "avx512_ratio": 1.0},
                          {"match": {"namespace": ns, "container": "scalar-a"}, "avx512_ratio": 0.0},
                          {"match": {"namespace": ns, "container": "scalar-b"}, "avx512_ratio": 0.0}],
        },
    }).start()
    try:
        def separated():
            a = _cpuset(cgs["avx-a"]) | _cpuset(cgs["avx-b"])
            s = _cpuset(cgs["scalar-a"]) | _cpuset(cgs["scalar-b"])
            return not (a & s)

        try:
            wait_for(separated, timeout=40, interval=0.5, what="AVX512 and scalar cgroups on disjoint CPUs")
        except AssertionError as e:
            hist = agent.get("/api/v1/rebalancer/history")
            raise AssertionError(f"{e}\ncpusets {({n: sorted(_cpuset(c)) for n, c in cgs.items()})}\n"
                                 f"last rounds {hist[-3:]}\nagent log:\n{agent.log_path.read_text()[-3000:]}") from None
        hist = agent.get("/api/v1/rebalancer/history")
        moved_rounds = [r for r in hist if r["outcomes"]]
        assert 1 <= len(moved_rounds) <= 4, hist  # "within a few rounds"
        applied = [o for r in moved_rounds for o in r["outcomes"]]
        assert applied and all(o["result"] == "applied" for o in applied), applied
        assert all(r["plan"]["cost_after"]["total"] <= r["plan"]["cost_before"]["total"] for r in moved_rounds)
        reasons = " ".join(m["reason"] for r in moved_rounds for m in r["plan"]["moves"])
        assert "AVX512" in reasons, reasons
        settled = {n: _cpuset(cg) for n, cg in cgs.items()}
        assert all(settled.values()), settled

        # Five more rounds: no move, cpusets unchanged.
        n0 = len(hist)
        wait_for(lambda: len(agent.get("/api/v1/rebalancer/history")) >= n0 + 5, timeout=30, interval=0.5,
                 what="five more rebalancer rounds")
        later = agent.get("/api/v1/rebalancer/history")[n0:]
        assert len(later) >= 5
        assert all(not r["outcomes"] and r["error"] is None for r in later), later
        assert {n: _cpuset(cg) for n, cg in cgs.items()} == settled

        metrics = agent.get("/metrics")
        applied_total = 'cri_resmgr_rebalancer_moves_total{result="applied"}'
        line = next(ln for ln in metrics.splitlines() if ln.startswith(applied_total))
        assert float(line.rsplit(" ", 1)[1]) == len(applied)
        assert "cri_resmgr_rebalancer_plan_duration_seconds" in metrics
        assert 'cri_resmgr_rebalancer_cost{when="after"}' in metrics
        plan = agent.get("/api/v1/rebalancer/plan")
        assert plan["mode"] == "enforce" and plan["rounds"] >= n0 + 5
        missing = plan["last"]["plan"]["missing_signals"]
        assert all("AVX512" not in m or "overrides" in m for m in missing), missing
    finally:
        agent.stop()
