"""remote_write round trip into a real Prometheus (Debian package) started with --web.enable-remote-write-receiver:
what the writer sends is queried back with PromQL, from a store driven by the test and from the running agent."""

from __future__ import annotations

import time

import pytest

from cri_resmgr.config import RemoteWriteConfig
from cri_resmgr.export.remote_write import RemoteWriter
from cri_resmgr.store import Sample, Store

from .helpers import AgentProcess, wait_for
from .prometheus import PrometheusServer, missing_reason

pytestmark = [pytest.mark.integration, pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")]


@pytest.fixture
def prom(tmp_path):
    p = PrometheusServer(tmp_path / "prom", remote_write_receiver=True)
    p.start()
    yield p
    p.stop()


def test_store_samples_round_trip_through_prometheus(prom):
    store = Store(retention_seconds=600)
    t0 = round(time.time()) - 20.0
    for r in range(10):
        store.append("cpu", t0 + r, [Sample("cri_resmgr_cpu_utilization_ratio", {"cpu": str(c), "core": str(c)},
                                            (r * 4 + c) / 100) for c in range(4)], 1.0)
    cfg = RemoteWriteConfig(url=prom.write_url, batch_max=7, self_metrics=False, external_labels={"job": "rw"})
    w = RemoteWriter(lambda: cfg, store, node_name="rw-node")
    w.cursor.seq = {}  # read the rows written above (the cursor normally starts at the store's end)
    w.collect(cfg)
    while (d := w.send_one(cfg)) is not None:
        time.sleep(d)
    assert w.sent_total == 40 and w.failed_total == 0 and w.retries_total == 0, w.last_error
    for r in range(10):
        got = prom.query('cri_resmgr_cpu_utilization_ratio{node="rw-node",job="rw"}', at=t0 + r)
        assert {s["metric"]["cpu"]: float(s["value"][1]) for s in got} == {
            str(c): pytest.approx((r * 4 + c) / 100) for c in range(4)}
    ts = prom.query('timestamp(cri_resmgr_cpu_utilization_ratio{cpu="2"})', at=t0 + 9)
    assert float(ts[0]["value"][1]) == t0 + 9


def test_running_agent_remote_writes_its_store(tmp_path, prom):
    agent = AgentProcess(tmp_path, {"node_name": "rw-agent",
                                    "export": {"remote_write": {"url": prom.write_url, "interval_seconds": 0.5,
                                                                "min_backoff_seconds": 0.2}}}).start()
    try:
        def metric(text, name):
            for line in text.splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
            return None

        wait_for(lambda: (metric(agent.get("/metrics"), "cri_resmgr_remote_write_samples_sent_total") or 0) > 0,
                 timeout=30, what="samples sent")
        got = wait_for(lambda: prom.query('cri_resmgr_cpu_busy_seconds_total{node="rw-agent"}'), timeout=30,
                       what="per-CPU series in prometheus")
        n_cpus = len(agent.get("/api/v1/topology")["cpus"])
        assert sorted(int(s["metric"]["cpu"]) for s in got) == list(range(n_cpus))
        # The exact sample the agent holds, at the timestamp Prometheus holds for it.
        ts = float(prom.query('timestamp(cri_resmgr_cpu_busy_seconds_total{node="rw-agent",cpu="0"})')[0]["value"][1])
        val = float(prom.query('cri_resmgr_cpu_busy_seconds_total{node="rw-agent",cpu="0"}', at=ts)[0]["value"][1])
        mine = agent.get("/api/v1/query_range", metric="cri_resmgr_cpu_busy_seconds_total",
                         **{"match[]": '{cpu="0"}'}, start=ts + 0.001, end=ts + 0.001, step=0.5, agg="last")
        assert mine["series"][0]["values"][0] == pytest.approx(val)
        # Self-metrics travel too (collector health), and nothing was lost.
        up = prom.query('cri_resmgr_collector_up{node="rw-agent",collector="cpu"}')
        assert up and float(up[0]["value"][1]) == 1.0
        text = agent.get("/metrics")
        assert metric(text, "cri_resmgr_remote_write_samples_dropped_total") == 0.0
        assert metric(text, "cri_resmgr_remote_write_samples_failed_total") == 0.0
    finally:
        assert agent.stop() == 0
