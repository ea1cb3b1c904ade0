"""One scrape target per node: the agent's /metrics carries the relay's metrics while the relay runs."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
from cri_api.v1 import api_pb2 as pb

from ..cri import CriClient
from ..helpers import AgentProcess
from .harness import RelayProcess

pytestmark = pytest.mark.integration


def test_agent_metrics_include_the_relays_and_survive_its_absence(containerd, tmp_path):
    relay = RelayProcess(tmp_path / "relay", containerd.socket).start()
    agent = AgentProcess(tmp_path,
                         {"relay": {"control_socket": str(relay.control)}}).start()
    try:
        with CriClient(relay.socket) as c:
            for _ in range(3):
                c.runtime.Version(pb.VersionRequest(version="v1"), timeout=10)
        text = agent.get("/metrics")
        lines = [ln for ln in text.splitlines()
                 if ln.startswith("cri_resmgr_relay_requests_total{") and "Version" in ln]
        assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 3, lines
        assert "cri_resmgr_collector_up{" in text  # the agent's own families are still there
        if shutil.which("promtool"):
            r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
        relay.stop()
        t0 = time.monotonic()
        text = agent.get("/metrics")
        assert time.monotonic() - t0 < 2.0
        assert "cri_resmgr_relay_requests_total" not in text and "cri_resmgr_collector_up{" in text
    finally:
        relay.stop()
        assert agent.stop() == 0
