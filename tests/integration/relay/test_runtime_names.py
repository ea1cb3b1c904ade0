"""Container series carry the Kubernetes names the runtime knows (real containerd, kubelet's CRI calls)."""

from __future__ import annotations

import time

import pytest

from ..cri import PodSpec, container_config
from ..helpers import AgentProcess, wait_for

pytestmark = pytest.mark.integration


def test_container_series_get_namespace_pod_and_container_names_from_the_runtime(containerd, kubelets, tmp_path):
    k = kubelets(containerd.socket)
    pod = k.run_pod(PodSpec("names-pod", namespace="team-a"))
    cid = k.run_container(pod, container_config("web", cpu_milli_request=100, cpu_milli_limit=200,
                                                command=["sh", "-c", "trap 'exit 0' TERM; while :; do :; done"]))
    agent = AgentProcess(tmp_path, {"collectors": {"cgroup": {"interval_seconds": 0.5,
                                                              "runtime_socket": str(containerd.socket)}}}).start()
    try:
        want = f'container="web",container_id="{cid}",namespace="team-a",pod="names-pod"'

        def line():
            return next((ln for ln in agent.get("/metrics").splitlines()
                         if ln.startswith("cri_resmgr_container_cpu_usage_seconds_total{") and want in ln), None)

        found = wait_for(line, timeout=20, what="named container series")
        assert f'pod_uid="{pod.spec.uid}"' in found
        conts = {c["container_id"]: c for c in agent.get("/api/v1/containers")}
        assert (conts[cid]["namespace"], conts[cid]["pod"], conts[cid]["name"]) == ("team-a", "names-pod", "web")
        time.sleep(1.5)
        now = time.time()
        hm = agent.get("/api/v1/heatmap", metric="cri_resmgr_container_cpu_usage_seconds_total", by="pod",
                       start=now - 3, end=now, step=1)
        assert "team-a/names-pod" in hm["rows"], hm["rows"]
        cols = {c["name"]: c for c in agent.get("/api/v1/collectors")}
        assert cols["cgroup"]["up"] and "runtime" not in cols["cgroup"]["reason"], cols["cgroup"]
    finally:
        assert agent.stop() == 0
