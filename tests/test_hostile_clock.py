"""A wall clock that steps (issue 12): through an injectable clock, the wall clock is set back 5 minutes in the
middle of collection. Rates must not spike, the default query window must show the newest samples, and the
timestamps remote_write sends must stay strictly increasing."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient

from cri_resmgr.clock import SteadyClock
from cri_resmgr.config import RemoteWriteConfig
from cri_resmgr.export.remote_write import RemoteWriter
from cri_resmgr.store import Sample, Store
from cri_resmgr.web.app import create_app

from .test_hostile_api import make_agent

BUSY = "cri_resmgr_cpu_busy_seconds_total"


class FakeTime:
    def __init__(self, wall: float = 1_700_000_000.0):
        self.wall_t, self.mono_t = wall, 1000.0

    def wall(self) -> float:
        return self.wall_t

    def mono(self) -> float:
        return self.mono_t

    def advance(self, s: float) -> None:
        self.wall_t += s
        self.mono_t += s


def test_steady_clock_ignores_a_backward_step_and_follows_a_forward_one():
    ft = FakeTime()
    c = SteadyClock(ft.wall, ft.mono)
    t1 = c()
    ft.advance(1)
    ft.wall_t -= 300  # NTP / VM restore: the wall clock goes back 5 minutes
    t2 = c()
    assert t2 - t1 == 1.0 and c.ahead_seconds == 300 and c.backward_steps_total == 1
    ft.advance(1)
    assert c() - t2 == 1.0 and c.backward_steps_total == 1  # counted once
    ft.wall_t += 600  # and forward past where we are (e.g. suspend): followed
    assert c() == ft.wall_t and c.forward_steps_total == 1 and c.ahead_seconds == 0


def test_store_refuses_rows_from_before_its_newest_instead_of_nudging():
    s = Store()
    for i in range(10):
        s.append("t", 1000.0 + i, [Sample("c_total", {}, float(i))])
    s.append("t", 800.0, [Sample("c_total", {}, 10.0)])  # a row stamped 5 min back
    assert s.rows_out_of_order == 1
    ts, vs = s.raw(s.select("c_total")[0], 0, 1e9)
    assert ts[-1] == 1009.0 and np.all(np.diff(ts) > 0.5)  # no row 1 ns after the last one


def test_backward_wall_step_neither_spikes_rates_nor_hides_new_data(tmp_path):
    ft = FakeTime()
    # Collector threads wait an hour (the rows below are written by hand); the retention keeps all of them.
    a = make_agent(tmp_path, clock=SteadyClock(ft.wall, ft.mono), store={"retention_seconds": 500_000})
    try:
        stat = a.cfg.paths.proc / "stat"
        cfg = RemoteWriteConfig(url="http://127.0.0.1:1/w", self_metrics=False)
        w = RemoteWriter(lambda: cfg, a.store, clock=a.now)  # its cursor starts at the rows written from now on
        for k in range(1, 121):  # 2 minutes at 1 s, the wall clock set back 5 minutes after the first minute
            ft.advance(1.0)
            if k == 60:
                ft.wall_t -= 300
            stat.write_text("".join(f"cpu{i} {50 * k} 0 0 {100 + 50 * k} 0 0 0 0\n" for i in range(7)))
            a.run_collector_once("cpu")
        c = TestClient(create_app(a))
        # Default window (the last 5 minutes by the agent's clock), 10 s steps.
        r = c.get("/api/v1/query_range", params={"metric": BUSY, "match[]": '{cpu="0"}', "fn": "rate", "step": 10})
        vals = [v for v in r.json()["series"][0]["values"] if v is not None]
        assert len(vals) >= 10, r.json()  # the newest minute is in the window, not 5 minutes in the future
        assert max(vals) < 0.55 and min(vals) > 0.45, vals  # 50 ticks of 100 Hz per second: 0.5, no spike
        st = c.get("/api/v1/store").json()
        assert st["clock_ahead_seconds"] >= 299 and st["rows_out_of_order_total"] == 0
        # remote_write: per series, strictly increasing millisecond timestamps.
        w.collect(cfg)
        by_series: dict = {}
        for q in w.queue:
            by_series.setdefault(q.key, []).append(q.timestamp_ms)
        assert by_series and max(len(ms) for ms in by_series.values()) >= 119
        for key, ms in by_series.items():
            assert all(b > a_ for a_, b in zip(ms, ms[1:], strict=False)), key
    finally:
        a.stop()
