import shutil
import subprocess
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cri_resmgr.agent import Agent
from cri_resmgr.config import build_config
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs
from cri_resmgr.web.app import create_app

from .cgroupfs import Values, make_v2

CID = "b" * 64
UID = "12345678-aaaa-bbbb-cccc-0123456789ab"


@pytest.fixture
def agent(tmp_path: Path):
    sysfs = build_sysfs(MACHINES["small-offline-isolated"], tmp_path / "sys")
    cg = tmp_path / "cgroup"
    make_v2(cg, f"kubepods/burstable/pod{UID}/{CID}", Values())
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "stat").write_text("".join(f"cpu{i} {i} 0 0 100 0 0 0 0\n" for i in range(7)))
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("api: {token: s3cret}\n")
    cfg = build_config(
        {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"), "api": {"token": "s3cret"},
         "paths": {"sysfs": str(sysfs), "cgroup": str(cg), "proc": str(proc)},
         "collectors": {"cgroup": {"interval_seconds": 3600}, "cpu": {"interval_seconds": 3600}}},
        env={"NODE_NAME": "t"})
    a = Agent(cfg, config_path=cfg_file)
    a.start()
    deadline = time.time() + 10
    while not a.ready() and time.time() < deadline:
        time.sleep(0.05)
    a.proc = proc
    yield a
    a.stop()


@pytest.fixture
def client(agent):
    return TestClient(create_app(agent))


def feed_cpu(agent, n=5):
    for k in range(1, n + 1):
        time.sleep(0.01)
        agent.proc.joinpath("stat").write_text(
            "".join(f"cpu{i} {i + 50 * k} 0 0 {100 + 50 * k} 0 0 0 0\n" for i in range(7)))
        agent.run_collector_once("cpu")


def test_health_and_ready(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200


def test_topology_endpoint(client):
    t = client.get("/api/v1/topology").json()
    assert t["online"] == "0-6" and t["offline"] == "7" and t["isolated"] == "3"
    assert len(t["cpus"]) == 7 and t["numa_nodes"][0]["distances"] == {"0": 10}


def test_containers_and_collectors(client):
    cs = client.get("/api/v1/containers").json()
    assert [c["container_id"] for c in cs] == [CID]
    assert cs[0]["qos_class"] == "Burstable" and cs[0]["cpuset"] == "0-1" and cs[0]["cpu_usage_seconds"] == 5.0
    cols = {c["name"]: c for c in client.get("/api/v1/collectors").json()}
    assert cols["cgroup"]["up"] and cols["cpu"]["up"] and cols["cgroup"]["reason"].startswith("cgroup v2")


def test_metrics_exposition(client):
    r = client.get("/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = r.text
    assert f'cri_resmgr_container_cpu_usage_seconds_total{{container="",container_id="{CID}"' in text
    assert 'cri_resmgr_collector_up{collector="cpu"} 1.0' in text
    assert "cri_resmgr_config_reload_errors_total 0.0" in text


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (Debian package prometheus)")
def test_metrics_pass_promtool(client, agent):
    feed_cpu(agent, 2)
    text = client.get("/metrics").text
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_query_range_and_heatmap(client, agent):
    feed_cpu(agent, 6)
    now = time.time()
    r = client.get("/api/v1/query_range", params={"metric": "cri_resmgr_cpu_busy_seconds_total",
                                                  "match[]": '{cpu="2"}', "start": now - 5, "end": now + 1,
                                                  "step": 6, "fn": "rate"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [s["labels"]["cpu"] for s in body["series"]] == ["2"] and body["unit"] == "ratio"
    h = client.get("/api/v1/heatmap", params={"metric": "cri_resmgr_cpu_utilization_ratio", "by": "core",
                                              "start": now - 5, "end": now + 1, "step": 6, "combine": "avg"}).json()
    assert h["rows"] == ["0", "1", "2", "3"] and len(h["values"]) == 4 and h["unit"] == "ratio"
    assert h["values"][0][-1] == pytest.approx(0.5)
    series = client.get("/api/v1/series", params={"metric": "cri_resmgr_cpu_busy_seconds_total"}).json()
    assert len(series) == 7


@pytest.mark.parametrize("params,status,needle", [
    ({"metric": "nope_total"}, 400, "unknown metric"),
    ({"metric": "cri_resmgr_cpu_busy_seconds_total", "step": 0}, 400, "step: must be > 0"),
    ({"metric": "cri_resmgr_cpu_busy_seconds_total", "agg": "median"}, 400, "agg must be"),
    ({"metric": "cri_resmgr_cpu_busy_seconds_total", "match[]": "{cpu="}, 400, "match[]"),
    ({"metric": "cri_resmgr_cpu_busy_seconds_total", "start": "yesterday"}, 422, "start"),
    ({"metric": "cri_resmgr_cpu_busy_seconds_total", "start": 10, "end": 5}, 400, "before start"),
])
def test_bad_query_parameters_say_what_is_wrong(client, params, status, needle):
    r = client.get("/api/v1/query_range", params=params)
    assert r.status_code == status and needle in r.text


def test_heatmap_bad_by(client):
    r = client.get("/api/v1/heatmap", params={"metric": "cri_resmgr_cpu_busy_seconds_total", "by": "rack"})
    assert r.status_code == 400 and "by must be one of" in r.text


def test_config_endpoint_redacts_token_and_reload_needs_it(client, agent):
    c = client.get("/api/v1config".replace("v1config", "v1/config")).json()
    assert c["active"]["api"]["token"] == "**********" and c["node_name"] == "t" and c["last_error"] is None
    assert client.post("/api/v1/config/reload").status_code == 401
    assert client.post("/api/v1/config/reload", headers={"Authorization": "Bearer wrong"}).status_code == 401
    Path(agent.config_path).write_text("collectors: {cpu: {interval_seconds: nope}}\n")
    r = client.post("/api/v1/config/reload", headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 409 and "collectors.cpu.interval_seconds" in r.json()["detail"]
    assert client.get("/api/v1/config").json()["reload_errors_total"] == 1
    assert "cri_resmgr_config_reload_errors_total 1.0" in client.get("/metrics").text


def test_openapi_lists_the_api(client):
    paths = client.get("/openapi.json").json()["paths"]
    for p in ["/api/v1/topology", "/api/v1/containers", "/api/v1/collectors", "/api/v1/series",
              "/api/v1/query_range", "/api/v1/heatmap", "/api/v1/config"]:
        assert p in paths
