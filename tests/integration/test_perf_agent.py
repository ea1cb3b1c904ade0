"""The real agent counting real perf software events for real busy cgroups, and bounding its descriptors."""

from __future__ import annotations

import os
import time

import pytest

from cri_resmgr.collectors.perf import find_perf_cgroup_root
from cri_resmgr.topology import discover

from ..test_perf import SW_EVENTS, PerfCgroup, _busy, _perf_fds
from .helpers import CGROUP_ROOT, AgentProcess, can_make_cgroups, wait_for
from .test_agent_process import metric_value

pytestmark = pytest.mark.integration

CLOCK = "cri_resmgr_container_cpu_clock_seconds_total"


@pytest.fixture
def cgroups():
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    root = find_perf_cgroup_root(CGROUP_ROOT)
    if root is None:
        pytest.skip("no hierarchy with the perf_event controller")
    made = []

    def make(busy: bool) -> PerfCgroup:
        cg = PerfCgroup(root.path).create()
        p = _busy(60) if busy else None
        if p:
            cg.add(p.pid)
        made.append((cg, p))
        return cg

    yield make
    for cg, p in made:
        if p:
            p.kill()
            p.wait()
        cg.remove()


def _collector(agent, name):
    return next(c for c in agent.get("/api/v1/collectors") if c["name"] == name)


def test_software_event_counts_of_a_busy_cgroup_rise_in_metrics(tmp_path, cgroups):
    cg = cgroups(busy=True)
    agent = AgentProcess(tmp_path, {"collectors": {"perf": {"interval_seconds": 0.5, "events": SW_EVENTS}}}).start()
    try:
        first = wait_for(lambda: metric_value(agent.get("/metrics"), CLOCK, cg.container_id),
                         what="cpu-clock in /metrics")
        time.sleep(2.0)
        text = agent.get("/metrics")
        second = metric_value(text, CLOCK, cg.container_id)
        assert second - first > 0.3, (first, second)  # a busy loop: up to 1 CPU-second per second
        assert metric_value(text, "cri_resmgr_container_page_faults_total", cg.container_id) > 0
        assert metric_value(text, "cri_resmgr_container_perf_context_switches_total", cg.container_id) is not None
        perf = _collector(agent, "perf")
        assert perf["up"] and perf["errors_total"] == 0, perf
        if 'cri_resmgr_perf_event_supported{error="ENOENT' in text:  # no PMU here: hardware events fail cleanly
            assert "unsupported events: cycles (ENOENT" in perf["reason"]
            assert metric_value(text, "cri_resmgr_container_cycles_total", cg.container_id) is None
        else:
            assert metric_value(text, "cri_resmgr_container_cycles_total", cg.container_id) > 0
    finally:
        assert agent.stop() == 0


def test_default_hardware_events_without_a_pmu_leave_the_agent_running(tmp_path):
    agent = AgentProcess(tmp_path, {"collectors": {"perf": {"interval_seconds": 0.5}}}).start()
    try:
        perf = wait_for(lambda: (c := _collector(agent, "perf"))["runs_total"] > 0 and c, what="a perf run")
        if perf["up"]:
            pytest.skip("this machine has a PMU: the default hardware events work")
        assert "none of the configured perf events is supported" in perf["reason"]
        assert "cycles (ENOENT" in perf["reason"]
        assert perf["errors_total"] == 0
        assert _collector(agent, "cgroup")["up"] and agent.get("/readyz")["status"] == "ready"
    finally:
        assert agent.stop() == 0


def test_agent_holds_at_most_its_descriptor_budget_with_many_cgroups(tmp_path, cgroups):
    n_cpus = len(discover(CGROUP_ROOT.parent.parent).online) or os.cpu_count()
    busy = cgroups(busy=True)
    idle = [cgroups(busy=False) for _ in range(6)]
    budget = 2 * n_cpus  # two containers with one event per CPU
    agent = AgentProcess(tmp_path, {"collectors": {"perf": {
        "interval_seconds": 0.5, "events": ["cpu-clock"], "max_descriptors": budget, "cpuset_only": False,
        "reselect_interval_seconds": 1}}}).start()
    try:
        wait_for(lambda: metric_value(agent.get("/metrics"), CLOCK, busy.container_id), timeout=30,
                 what="the busiest container watched after a reselection")
        text = agent.get("/metrics")
        assert _perf_fds(agent.proc.pid) <= budget
        skipped = [c for c in idle if 'reason="budget"' in next(
            (ln for ln in text.splitlines() if ln.startswith("cri_resmgr_container_perf_monitored{")
             and c.container_id in ln), "")]
        assert len(skipped) >= len(idle) - 1, text
        assert "skipped" in _collector(agent, "perf")["reason"]
        held = next(ln for ln in text.splitlines() if ln.startswith("cri_resmgr_perf_open_descriptors "))
        assert float(held.split()[1]) <= budget
    finally:
        assert agent.stop() == 0
