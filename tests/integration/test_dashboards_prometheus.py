"""Every dashboard query against a real Prometheus (Debian package) scraping a running agent on this machine.

A query passes when Prometheus answers it with data. A query whose metrics the agent does not export here is
skipped, and the skip names each missing metric and why: planned (the issue that will export it), or defined but
not exported on this machine (with the collector's down reason from /api/v1/collectors)."""

from __future__ import annotations

import time

import httpx
import pytest

from ..dashq import all_queries, concrete, generator, metric_names, spec_of
from .helpers import AgentProcess, RealCgroup, can_make_cgroups, wait_for
from .prometheus import PrometheusServer, missing_reason

pytestmark = [pytest.mark.integration, pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")]

QUERIES = all_queries()


class Setup:
    agent: AgentProcess
    prom: PrometheusServer
    exported: set[str]
    collectors: dict[str, dict]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    import subprocess
    import sys

    tmp = tmp_path_factory.mktemp("dashboards")
    s = Setup()
    cg = proc = None
    if can_make_cgroups() is None:
        # A container that works (CPU, memory) so the container panels have series; a light loop.
        cg = RealCgroup().create()
        proc = subprocess.Popen([sys.executable, "-c",
                                 "import time\nwhile True:\n    sum(range(20000)); time.sleep(0.002)"])
        cg.add(proc.pid)
    # The agent also remote-writes one counter to the same Prometheus, so the remote_write panel has data.
    s.agent = AgentProcess(tmp)
    s.prom = PrometheusServer(tmp / "prom", scrape_targets=[f"127.0.0.1:{s.agent.port}"], remote_write_receiver=True)
    s.agent.config["export"] = {"remote_write": {"url": s.prom.write_url, "interval_seconds": 1,
                                                 "metric_regex": "cri_resmgr_remote_write_samples_sent_total"}}
    # Rebalancer rounds (advise mode, the default) every second, so its panels have series too.
    s.agent.config["rebalancer"] = {"interval_seconds": 1, "window_seconds": 3}
    s.agent.write_config(s.agent.config)
    s.prom.start()
    s.agent.start()
    try:
        wait_for(s.prom.targets_up, timeout=30, what="prometheus scraping the agent")
        time.sleep(6)  # several scrapes, so rate() over $__rate_interval has samples
        text = s.agent.get("/metrics")
        s.exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
        s.collectors = {c["name"]: c for c in s.agent.get("/api/v1/collectors")}
        yield s
    finally:
        s.agent.stop()
        s.prom.stop()
        if proc:
            proc.kill()
            proc.wait()
        if cg:
            cg.remove()


def why_missing(name: str, s: Setup, planned: dict[str, str]) -> str:
    if name in planned:
        return f"{name}: not exported yet, planned for the {planned[name]}"
    if spec_of(name) is None:
        return f"{name}: not defined in cri_resmgr/metrics.py"
    down = [f"{c['name']} ({c['reason'][:70]})" for c in s.collectors.values() if not c["up"]]
    return (f"{name}: defined but not exported by the agent on this machine"
            + (f" (collectors down: {'; '.join(down)})" if down else " (no series yet: nothing to count here)"))


@pytest.mark.parametrize("dashboard,panel,expr", QUERIES,
                         ids=[f"{d}:{p}:{i}" for i, (d, p, _e) in enumerate(QUERIES)])
def test_query_returns_data_from_prometheus(live, dashboard, panel, expr):
    planned = generator().PLANNED_METRICS
    names = metric_names(expr)
    missing = [n for n in names if n not in live.exported]
    if missing:
        pytest.skip("; ".join(why_missing(n, live, planned) for n in missing))
    q = concrete(expr)
    result = wait_for(lambda: live.prom.query(q), timeout=15, what=f"data for {q!r}")
    assert result, q


def test_dashboard_variables_resolve(live):
    r = httpx.get(live.prom.url + "/api/v1/label/instance/values", params={"match[]": "cri_resmgr_collector_up"}).json()
    assert r["data"] == [f"127.0.0.1:{live.agent.port}"]
    if "cri_resmgr_container_cpu_usage_seconds_total" in live.exported:
        r = httpx.get(live.prom.url + "/api/v1/label/namespace/values",
                      params={"match[]": "cri_resmgr_container_cpu_usage_seconds_total"}).json()
        assert r["status"] == "success"


def test_todays_core_metrics_are_exported(live):
    """The guard against skipping what must work: the foundation's metrics are scraped and answer."""
    core = {"cri_resmgr_cpu_utilization_ratio", "cri_resmgr_cpu_busy_seconds_total", "cri_resmgr_collector_up",
            "cri_resmgr_store_series", "cri_resmgr_remote_write_samples_sent_total"}
    if can_make_cgroups() is None:
        core |= {"cri_resmgr_container_cpu_usage_seconds_total", "cri_resmgr_container_memory_working_set_bytes"}
    assert core <= live.exported, core - live.exported
