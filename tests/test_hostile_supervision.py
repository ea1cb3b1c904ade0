"""Background loops are supervised, config bounds hold, table geometry follows a reload, and the series limit
counts series (issue 12)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cri_resmgr.config import ConfigError, build_config
from cri_resmgr.store import Sample, Store
from cri_resmgr.supervise import LoopStatus, run_supervised
from cri_resmgr.web.app import create_app

from .test_hostile_api import make_agent


def test_a_failing_loop_is_restarted_with_back_off_and_counted():
    stop = threading.Event()
    runs: list[float] = []

    def body():
        runs.append(time.monotonic())
        if len(runs) < 4:
            raise RuntimeError(f"boom {len(runs)}")
        stop.wait()

    st = LoopStatus("test")
    t = threading.Thread(target=run_supervised, args=(st, body, stop), kwargs={"backoff_min": 0.05}, daemon=True)
    t.start()
    deadline = time.time() + 10
    while len(runs) < 4 and time.time() < deadline:
        time.sleep(0.01)
    assert len(runs) == 4 and st.restarts_total == 3 and st.last_error == "RuntimeError: boom 3" and st.running
    gaps = [b - a for a, b in zip(runs, runs[1:], strict=False)]
    assert gaps[1] > gaps[0] * 1.5  # the back-off doubles
    stop.set()
    t.join(5)
    assert not t.is_alive() and not st.running


def test_agent_loops_are_listed_with_their_restarts(tmp_path):
    a = make_agent(tmp_path)
    try:
        loops = {x["name"]: x for x in TestClient(create_app(a)).get("/api/v1/loops").json()}
        assert {"checkpoint", "remote_write", "rebalancer"} <= set(loops)
        assert all(x["running"] and x["restarts_total"] == 0 for x in loops.values()), loops
    finally:
        a.stop()


@pytest.mark.parametrize("data,key", [
    ({"collectors": {"cpu": {"interval_seconds": 1e-6}}}, "collectors.cpu.interval_seconds"),
    ({"collectors": {"cgroup": {"interval_seconds": 1e9}}}, "collectors.cgroup.interval_seconds"),
    ({"store": {"retention_seconds": 1}}, "store.retention_seconds"),
    ({"store": {"retention_seconds": 1e12}}, "store.retention_seconds"),
    ({"store": {"checkpoint_interval_seconds": 0.001}}, "store.checkpoint_interval_seconds"),
    ({"store": {"max_series": 10**12}}, "store.max_series"),
    ({"rebalancer": {"interval_seconds": 0.0001}}, "rebalancer.interval_seconds"),
    ({"api": {"max_concurrent_queries": 0}}, "api.max_concurrent_queries"),
    ({"export": {"remote_write": {"url": "http://x/w", "interval_seconds": 1e-9}}},
     "export.remote_write.interval_seconds"),
])
def test_config_bounds(data, key):
    with pytest.raises(ConfigError) as e:
        build_config(data, env={})
    assert any(p.startswith(key + ":") for p in e.value.problems), e.value.problems


def test_reload_with_a_new_interval_keeps_the_retention(tmp_path):
    a = make_agent(tmp_path, store={"retention_seconds": 600},
                   collectors={"cgroup": {"interval_seconds": 3600}, "cpu": {"interval_seconds": 10}})
    try:
        assert a.store.tables["cpu"].capacity == a.store.capacity_for(10) == 61
        Path(a.config_path).write_text("store: {retention_seconds: 600}\ncollectors: {cpu: {interval_seconds: 2}}\n"
                                       "api: {token: s3cret-token}\n")
        assert a.reload()
        assert a.store.tables["cpu"].capacity == 301  # 600 s at 2 s, not 61 rows = 122 s
        assert "store" not in a.config_state.pending_restart
        st = TestClient(create_app(a)).get("/api/v1/store").json()
        assert {t["name"]: t["capacity_rows"] for t in st["tables"]}["cpu"] == 301
    finally:
        a.stop()


def test_growing_a_table_keeps_no_phantom_rows():
    s = Store(retention_seconds=10)
    for i in range(40):  # capacity 11: rows 29..39 kept
        s.append("t", 1000.0 + i, [Sample("g", {}, float(i))], 1.0)
    assert s.resize("t", 0.25)  # capacity 41 now, but rows 0..28 are gone
    ts, vs = s.raw(s.select("g")[0], 0, 1e9)
    assert list(vs) == [float(i) for i in range(29, 40)] and list(ts) == [1000.0 + i for i in range(29, 40)]
    for i in range(40, 80):
        s.append("t", 1000.0 + i, [Sample("g", {}, float(i))], 0.25)
    ts, vs = s.raw(s.select("g")[0], 0, 1e9)
    assert len(vs) == 41 and vs[-1] == 79.0 and vs[0] == 39.0


def test_series_limit_counts_series_not_samples_and_shows_in_store_status(tmp_path):
    s = Store(max_series=3)
    for i in range(50):  # the same two refused series, fifty rows
        s.append("t", 1000.0 + i, [Sample("g", {"k": str(k)}, 1.0) for k in range(5)])
    assert s.series_count == 3 and s.dropped_series == 2 and s.dropped_samples == 100
    a = make_agent(tmp_path, store={"max_series": 5})
    try:
        st = TestClient(create_app(a)).get("/api/v1/store").json()
        assert st["max_series"] == 5 and st["series"] == 5 and st["series_dropped_total"] > 0
        text = "".join(f"{d.spec.name} {d.value}\n" for d in a.self_metrics())
        assert f"cri_resmgr_store_series_dropped_total {float(st['series_dropped_total'])}" in text
    finally:
        a.stop()


def test_remote_write_loop_survives_an_error_outside_its_own_handling(tmp_path):
    # A CA file that is not PEM: building the TLS client raises ssl.SSLError, which the send path does not expect.
    # Before supervision this ended the writer's thread silently.
    from cri_resmgr.config import RemoteWriteConfig
    from cri_resmgr.export.remote_write import RemoteWriter

    bad_ca = tmp_path / "ca.pem"
    bad_ca.write_text("not a certificate\n")
    cfg = RemoteWriteConfig(url="https://127.0.0.1:1/write", tls_ca_file=bad_ca, interval_seconds=0.1,
                            self_metrics=False)
    s = Store()
    s.append("t", 1000.0, [Sample("g", {}, 1.0)])
    w = RemoteWriter(lambda: cfg, s)
    s.append("t", 1001.0, [Sample("g", {}, 2.0)])
    w.start()
    try:
        deadline = time.time() + 10
        while w.loop_status.restarts_total < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert w.loop_status.restarts_total >= 2 and "SSL" in (w.loop_status.last_error or "")
        assert w._thread is not None and w._thread.is_alive()
    finally:
        w.stop(flush_timeout=0.1)
