"""deploy/kustomize/nri: the NRI-mode variant (base + the plugin's DaemonSet) validates against the Kubernetes
API schemas, and the plugin's mounts, config and arguments agree with each other and with the agent's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cri_resmgr.cli import build_parser
from cri_resmgr.config import build_config
from cri_resmgr.nri.server import CONTROL_NAME

ROOT = Path(__file__).resolve().parent.parent
NRI = ROOT / "deploy" / "kustomize" / "nri"
BASE = ROOT / "deploy" / "kustomize" / "base"
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (PyPI) is not installed")
VERSIONS = [kv.latest_version(), "1.28.0"]
# Host paths the plugin may mount, each with why.
ALLOWED_HOST_PATHS = {
    "/var/run/nri": "the runtime's NRI socket (the directory: a restarted runtime makes a new socket)",
    "/sys/fs/cgroup": "read-only: containers' cpusets for the invariant checks",
    "/var/run/cri-resmgr": "lock and control socket, shared with the agent",
    "/var/lib/cri-resmgr/nri": "placement cache",
}


def plugin_daemonset() -> dict:
    return yaml.safe_load((NRI / "daemonset-nri.yaml").read_text())


def test_overlay_lists_the_base_and_existing_files():
    k = yaml.safe_load((NRI / "kustomization.yaml").read_text())
    assert "../base" in k["resources"]
    for f in [r for r in k["resources"] if r != "../base"]:
        assert (NRI / f).is_file(), f
    for g in k["configMapGenerator"]:
        for f in g["files"]:
            assert (NRI / f.split("=")[-1]).is_file(), f


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_daemonset_validates_strictly(version):
    kv.validate(plugin_daemonset(), version, strict=True)


def test_plugin_has_no_capabilities_and_only_the_mounts_it_needs():
    ds = plugin_daemonset()
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert "hostPID" not in pod and "hostNetwork" not in pod and pod["automountServiceAccountToken"] is False
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host.values()) == set(ALLOWED_HOST_PATHS), set(host.values()) ^ set(ALLOWED_HOST_PATHS)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert set(mounts) == {v["name"] for v in pod["volumes"]}
    assert mounts["cgroup"]["readOnly"]
    # The plugin's configured paths are where the host paths are mounted, and it runs `cri-resmgr nri`.
    cfg = build_config(yaml.safe_load((NRI / "config-nri.yaml").read_text()), env={})
    mount_of = {host[n]: m["mountPath"] for n, m in mounts.items() if n in host}
    assert cfg.nri.socket.parent == Path(mount_of["/var/run/nri"])
    assert str(cfg.paths.cgroup) == mount_of["/sys/fs/cgroup"]
    assert str(cfg.run_dir) == mount_of["/var/run/cri-resmgr"]
    assert str(cfg.state_dir) == mount_of["/var/lib/cri-resmgr/nri"]
    args = build_parser().parse_args(c["args"])
    assert args.cmd == "nri" and str(args.config) == mounts["config"]["mountPath"] + "/config.yaml"


def test_agent_finds_the_plugins_control_socket():
    # The agent (web/app.py, rebalancer/service.py) looks at relay.control_socket, else run_dir/relay-control.sock.
    agent = yaml.safe_load((BASE / "config.yaml").read_text())
    agent_looks = agent.get("relay", {}).get("control_socket") or Path(agent["run_dir"]) / "relay-control.sock"
    plugin = build_config(yaml.safe_load((NRI / "config-nri.yaml").read_text()), env={})
    plugin_serves = plugin.nri.control_socket or plugin.run_dir / CONTROL_NAME
    assert Path(agent_looks) == Path(plugin_serves)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed")
def test_kustomize_build_of_the_overlay_validates():
    out = subprocess.run(["kubectl", "kustomize", str(NRI)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for d in docs:
        if not d["apiVersion"].startswith("monitoring.coreos.com/"):
            kv.validate(d, VERSIONS[0], strict=True)
    dss = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DaemonSet"}
    assert set(dss) == {"cri-resmgr", "cri-resmgr-nri"}
    nri = dss["cri-resmgr-nri"]["spec"]["template"]["spec"]
    assert nri["containers"][0]["image"].startswith("ghcr.io/cri-resmgr/cri-resmgr:")
    cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    (vol,) = [v for v in nri["volumes"] if v["name"] == "config"]
    build_config(yaml.safe_load(cms[vol["configMap"]["name"]]["data"]["config.yaml"]), env={})
