"""REST of the rebalancer on a real Agent over fixture trees: plan, history, run (token), modes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cri_resmgr.agent import Agent
from cri_resmgr.config import build_config
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs
from cri_resmgr.web.app import create_app

from .cgroupfs import Values, make_v2

UID = "12345678-aaaa-bbbb-cccc-0123456789ab"
IDS = [c * 64 for c in "abcd"]


def make_agent(tmp_path: Path, **rebalancer) -> Agent:
    sysfs = build_sysfs(MACHINES["small-offline-isolated"], tmp_path / "sys")
    cg = tmp_path / "cgroup"
    for cid in IDS:
        make_v2(cg, f"kubepods/burstable/pod{UID}/{cid}", Values(cpus="0-2,4-6"))
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "stat").write_text("".join(f"cpu{i} {i} 0 0 100 0 0 0 0\n" for i in range(7)))
    cfg = build_config(
        {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"), "api": {"token": "s3cret"},
         "paths": {"sysfs": str(sysfs), "cgroup": str(cg), "proc": str(proc), "resctrl": str(tmp_path / "none")},
         "collectors": {"cgroup": {"interval_seconds": 3600}, "cpu": {"interval_seconds": 3600}},
         "rebalancer": {"interval_seconds": 3600, "window_seconds": 10, **rebalancer,
                        "overrides": [{"match": {"container_id": IDS[0]}, "avx512_ratio": 1.0}]}},
        env={"NODE_NAME": "t"})
    a = Agent(cfg)
    a.start()
    a.cg = cg
    return a


def feed(agent: Agent, rounds: int = 4, usage_step_us: int = 900_000) -> None:
    """Advance every container's CPU usage by ``usage_step_us`` (0.9 s) per collection (about 1 s apart) and
    collect."""
    for _ in range(rounds):
        for cid in IDS:
            f = agent.cg / f"kubepods/burstable/pod{UID}/{cid}/cpu.stat"
            text = f.read_text().splitlines()
            usage = int(text[0].split()[1]) + usage_step_us
            f.write_text("\n".join([f"usage_usec {usage}"] + text[1:]) + "\n")
        time.sleep(1.0)
        agent.run_collector_once("cgroup")


@pytest.fixture
def agent(tmp_path):
    a = make_agent(tmp_path)
    yield a
    a.stop()


def test_plan_history_and_run_with_token(agent):
    c = TestClient(create_app(agent))
    st = c.get("/api/v1/rebalancer/plan").json()
    assert st["mode"] == "advise" and st["rounds"] == 0 and st["last"] is None
    assert c.post("/api/v1/rebalancer/run").status_code == 401
    assert c.post("/api/v1/rebalancer/run", headers={"Authorization": "Bearer nope"}).status_code == 401
    feed(agent)
    r = c.post("/api/v1/rebalancer/run", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200, r.text
    rec = r.json()
    assert rec["mode"] == "advise" and rec["error"] is None
    plan = rec["plan"]
    assert plan["containers"] == 4 and plan["moves"], plan
    assert all(o["result"] == "advised" for o in rec["outcomes"])
    assert any("AVX512" in m["reason"] for m in plan["moves"])
    # each move explains itself: gain by term, and who hurt whom (the AVX512 container is the antagonist)
    for m in plan["moves"]:
        assert sum(m["gain_by_term"].values()) == pytest.approx(m["predicted_gain"], abs=1e-6)
    seps = [s for m in plan["moves"] for s in m["separates"]]
    avx = [s for s in seps if s["term"].startswith("avx512")]
    assert avx and all(s["antagonist"] == IDS[0] and s["victim"] in IDS[1:] for s in avx)
    assert plan["cost_after"]["total"] < plan["cost_before"]["total"]
    st = c.get("/api/v1/rebalancer/plan").json()
    assert st["rounds"] == 1 and st["last"] == rec and st["moves_total"]["advised"] == len(rec["outcomes"])
    hist = c.get("/api/v1/rebalancer/history").json()
    assert hist == [rec]
    assert c.get("/api/v1/rebalancer/history", params={"limit": 0}).status_code == 422
    # enforcing needs the configured mode
    r = c.post("/api/v1/rebalancer/run", params={"mode": "enforce"}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 409
    # metrics of the round are exported
    text = c.get("/metrics").text
    assert 'cri_resmgr_rebalancer_moves_total{result="advised"}' in text
    assert 'cri_resmgr_rebalancer_cost{when="before"}' in text
    assert "cri_resmgr_rebalancer_plan_duration_seconds" in text
    assert "/api/v1/rebalancer/run" in c.get("/openapi.json").json()["paths"]


def test_run_refused_when_off(tmp_path):
    a = make_agent(tmp_path, mode="off")
    try:
        c = TestClient(create_app(a))
        r = c.post("/api/v1/rebalancer/run", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 409 and "off" in r.json()["detail"]
    finally:
        a.stop()


def test_agent_loop_runs_rounds_at_the_interval(tmp_path):
    a = make_agent(tmp_path, interval_seconds=0.2, skip_threshold=0)  # every round planned and recorded
    try:
        feed(a, 2)
        deadline = time.time() + 10
        while len(a.rebalancer.engine.history) < 3 and time.time() < deadline:
            time.sleep(0.1)
        assert len(a.rebalancer.engine.history) >= 3
        assert a.rebalancer.engine.last.mode == "advise"
    finally:
        t0 = time.time()
        a.stop()
        assert time.time() - t0 < 10  # the loop wakes on stop
