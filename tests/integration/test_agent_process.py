"""The real agent, as a subprocess, on this machine's real cgroups."""

import signal
import subprocess
import sys
import time

import pytest

from .helpers import AgentProcess, RealCgroup, busy_process, can_make_cgroups, wait_for

pytestmark = pytest.mark.integration

USAGE = "cri_resmgr_container_cpu_usage_seconds_total"


def metric_value(text: str, name: str, needle: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and needle in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def busy_container():
    reason = can_make_cgroups()
    if reason:
        pytest.skip(reason)
    cg = RealCgroup().create()
    p = busy_process()
    try:
        cg.add(p.pid)
        yield cg
    finally:
        p.kill()
        p.wait()
        cg.remove()


def test_busy_container_cpu_rises_in_metrics_query_range_and_heatmap(tmp_path, busy_container):
    cid = busy_container.container_id
    agent = AgentProcess(tmp_path).start()
    try:
        first = wait_for(lambda: metric_value(agent.get("/metrics"), USAGE, cid), what="container in /metrics")
        time.sleep(2.5)
        second = metric_value(agent.get("/metrics"), USAGE, cid)
        assert second - first > 1.0, (first, second)  # a busy loop burns ~1 CPU-second per second
        text = agent.get("/metrics")
        assert f'pod_uid="{busy_container.pod_uid}"' in text and 'qos_class="Burstable"' in text

        now = time.time()
        qr = agent.get("/api/v1/query_range", metric=USAGE, **{"match[]": f'{{container_id="{cid}"}}'},
                       start=now - 3, end=now, step=1, fn="rate")
        (series,) = qr["series"]
        rates = [v for v in series["values"] if v is not None]
        assert rates and max(rates) > 0.25, series  # ~1.0 alone; a loaded 2-CPU machine halves it

        hm = agent.get("/api/v1/heatmap", metric=USAGE, by="container", start=now - 3, end=now, step=1)
        row = hm["rows"].index(cid[:12])
        assert max(v for v in hm["values"][row] if v is not None) > 0.25, hm
        hm_cpu = agent.get("/api/v1/heatmap", metric="cri_resmgr_cpu_busy_seconds_total", by="cpu",
                           start=now - 3, end=now, step=1)
        assert hm_cpu["rows"] == [str(i) for i in range(len(hm_cpu["rows"]))] and hm_cpu["unit"] == "ratio"
        conts = agent.get("/api/v1/containers")
        assert any(c["container_id"] == cid and c["pod_uid"] == busy_container.pod_uid for c in conts)
    finally:
        assert agent.stop() == 0


def test_second_instance_is_refused_and_stale_lock_does_not_block(tmp_path):
    first = AgentProcess(tmp_path, name="first").start()
    try:
        second = AgentProcess(tmp_path, name="second")  # same run_dir
        r = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "run", "--config", str(second.config_path)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1
        assert f"already running (pid {first.proc.pid})" in r.stderr
    finally:
        first.stop(signal.SIGKILL)
    assert (tmp_path / "run" / "cri-resmgr.lock").exists()  # left behind by the killed process
    again = AgentProcess(tmp_path, name="again").start()
    assert again.stop() == 0


def test_sighup_with_broken_file_keeps_old_config(tmp_path):
    agent = AgentProcess(tmp_path, {"collectors": {"cpu": {"interval_seconds": 0.5}}}).start()
    try:
        good = dict(agent.config)
        agent.config_path.write_text("collectors:\n  cpu:\n    interval_seconds: -3\n    colour: blue\n")
        agent.send(signal.SIGHUP)
        cfg = wait_for(lambda: (c := agent.get("/api/v1/config"))["last_error"] and c, what="reload error")
        assert "collectors.cpu.interval_seconds" in cfg["last_error"]
        assert "collectors.cpu.colour: unknown key" in cfg["last_error"]
        assert cfg["active"]["collectors"]["cpu"]["interval_seconds"] == 0.5 and cfg["reload_errors_total"] == 1
        assert "cri_resmgr_config_reload_errors_total 1.0" in agent.get("/metrics")
        runs = {c["name"]: c["runs_total"] for c in agent.get("/api/v1/collectors")}
        time.sleep(1.2)
        after = {c["name"]: c for c in agent.get("/api/v1/collectors")}
        assert after["cpu"]["runs_total"] > runs["cpu"] and after["cpu"]["up"]  # still collecting
        # A good file is then accepted; a changed listen address is reported as needing a restart.
        good["collectors"]["cpu"]["interval_seconds"] = 0.25
        good["listen"] = "127.0.0.1:1"
        agent.write_config(good)
        agent.send(signal.SIGHUP)
        cfg = wait_for(lambda: (c := agent.get("/api/v1/config"))["reloads_total"] == 1 and c, what="reload")
        assert cfg["last_error"] is None and cfg["active"]["collectors"]["cpu"]["interval_seconds"] == 0.25
        assert cfg["pending_restart"] == ["listen"] and cfg["active"]["listen"] == f"127.0.0.1:{agent.port}"
    finally:
        assert agent.stop() == 0


def test_sigkill_then_restart_restores_checkpointed_history(tmp_path):
    agent = AgentProcess(tmp_path).start()
    t0 = time.time()
    ckpt = tmp_path / "state" / "store.npz"
    wait_for(lambda: time.time() - t0 > 2.5 and ckpt.exists() and ckpt.stat().st_mtime > t0 + 2, timeout=30,
             what="a checkpoint with history")
    before = agent.get("/api/v1/query_range", metric="cri_resmgr_cpu_busy_seconds_total", start=t0, end=t0 + 2,
                       step=0.5, agg="last")
    n_before = sum(v is not None for s in before["series"] for v in s["values"])
    assert n_before > 0
    agent.stop(signal.SIGKILL)
    assert agent.proc.returncode == -signal.SIGKILL
    agent2 = AgentProcess(tmp_path, name="restarted")
    agent2.start()
    try:
        after = agent2.get("/api/v1/query_range", metric="cri_resmgr_cpu_busy_seconds_total", start=t0, end=t0 + 2,
                           step=0.5, agg="last")
        assert after["series"] == before["series"]
        assert "restored" in agent2.log_path.read_text()
    finally:
        assert agent2.stop() == 0


def test_corrupt_checkpoint_does_not_stop_start(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "store.npz").write_bytes(b"PK\x03\x04 not really a zip")
    agent = AgentProcess(tmp_path).start()
    try:
        assert "unreadable" in agent.log_path.read_text()
        assert list((tmp_path / "state").glob("store.npz.corrupt-*"))
    finally:
        assert agent.stop() == 0
