"""deploy/: Kubernetes manifests valid against the API schemas that kubernetes-validate ships (offline), consistent
with each other and with the agent's configuration; systemd units of the relay; the container build file."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cri_resmgr.cli import build_parser
from cri_resmgr.config import Config, ConfigError, build_config

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "deploy" / "kustomize" / "base"
SYSTEMD = ROOT / "deploy" / "systemd"
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (PyPI) is not installed")

# Kubernetes versions to validate against: the newest schema the package ships and an older supported release.
VERSIONS = [kv.latest_version(), "1.28.0"]
# Host paths the DaemonSet may mount, each with why (the agent's needs; nothing else of the host).
ALLOWED_HOST_PATHS = {
    "/sys/fs/cgroup": "cgroup accounting and container discovery",
    "/sys/fs/resctrl": "RDT monitoring groups",
    "/sys/kernel/btf": "BTF for the CO-RE eBPF object",
    "/sys/kernel/tracing": "tracefs for the bcc fallback",
    "/var/run/cri-resmgr": "the relay's control socket, the agent's lock",
    "/run/containerd/containerd.sock": "the runtime socket",
    "/var/lib/cri-resmgr/agent": "store checkpoint",
}


def kustomization() -> dict:
    return yaml.safe_load((BASE / "kustomization.yaml").read_text())


def resources() -> list[dict]:
    out = []
    for f in kustomization()["resources"]:
        out += [d for d in yaml.safe_load_all((BASE / f).read_text()) if d]
    return out


def by_kind(kind: str) -> list[dict]:
    return [r for r in resources() if r["kind"] == kind]


def test_kustomization_lists_existing_files():
    k = kustomization()
    for f in k["resources"] + [f for g in k.get("configMapGenerator", []) for f in g["files"]]:
        assert (BASE / f).is_file(), f
    assert {r["kind"] for r in resources()} == {"Namespace", "ServiceAccount", "Role", "RoleBinding", "DaemonSet",
                                                "Service", "ServiceMonitor"}


@pytest.mark.parametrize("version", VERSIONS)
def test_builtin_resources_validate_strictly(version):
    checked = 0
    for r in resources():
        if r["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in kubernetes-validate; checked structurally below
        kv.validate(r, version, strict=True)  # raises ValidationError naming the field
        checked += 1
    assert checked == 6


def test_validation_rejects_a_broken_daemonset():
    (ds,) = by_kind("DaemonSet")
    ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"] = "BPF"  # not a list
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, VERSIONS[0], strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed")
def test_kustomize_build_validates_and_wires_the_config():
    out = subprocess.run(["kubectl", "kustomize", str(BASE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert all(d["metadata"].get("namespace") == "cri-resmgr" for d in docs if d["kind"] != "Namespace")
    for d in docs:
        if not d["apiVersion"].startswith("monitoring.coreos.com/"):
            kv.validate(d, VERSIONS[0], strict=True)
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"]  # the hashed name, rewritten
    env = {e["name"]: e for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    # The pod's address is not loopback: the config alone is refused, the read token from the Secret makes it start.
    assert env["CRI_RESMGR_API__READ_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "read-token"
    with pytest.raises(ConfigError, match=r"api\.read_token"):
        build_config(yaml.safe_load(cm["data"]["config.yaml"]), env={})
    build_config(yaml.safe_load(cm["data"]["config.yaml"]), env={"CRI_RESMGR_API__READ_TOKEN": "from-secret"})
    assert ds["spec"]["template"]["spec"]["containers"][0]["image"].startswith("ghcr.io/cri-resmgr/cri-resmgr:")


def test_daemonset_has_only_the_capabilities_and_mounts_it_needs():
    (ds,) = by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == {"BPF", "PERFMON", "SYS_RESOURCE"}
    assert pod["hostPID"] is True and "hostNetwork" not in pod and pod["automountServiceAccountToken"] is False
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert set(host.values()) <= set(ALLOWED_HOST_PATHS), set(host.values()) - set(ALLOWED_HOST_PATHS)
    for needed in ("/sys/fs/cgroup", "/sys/fs/resctrl", "/sys/kernel/btf", "/sys/kernel/tracing",
                   "/run/containerd/containerd.sock"):
        assert needed in host.values(), needed
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert set(mounts) == {v["name"] for v in pod["volumes"]}  # every volume mounted, every mount backed
    assert mounts["cgroup"]["readOnly"] and mounts["btf"]["readOnly"] and mounts["tracefs"]["readOnly"]
    # The agent's configured roots are where the host paths are mounted.
    cfg = build_config(yaml.safe_load((BASE / "config.yaml").read_text()), env={"CRI_RESMGR_API__READ_TOKEN": "t"})
    mount_of = {host[n]: m["mountPath"] for n, m in mounts.items() if n in host}
    assert str(cfg.paths.cgroup) == mount_of["/sys/fs/cgroup"]
    assert str(cfg.paths.resctrl) == mount_of["/sys/fs/resctrl"]
    assert str(cfg.run_dir) == mount_of["/var/run/cri-resmgr"]
    assert str(cfg.state_dir) == mount_of["/var/lib/cri-resmgr/agent"]
    # It listens where the probes, the Service and the ServiceMonitor look.
    host_, port = cfg.listen_address()
    assert host_ == "0.0.0.0" and {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": port}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert build_parser().parse_args(c["args"]).cmd == "run"
    assert [e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if e["name"] == "NODE_NAME"] == ["spec.nodeName"]


def test_service_and_servicemonitor_select_the_agents():
    (ds,) = by_kind("DaemonSet")
    (svc,) = by_kind("Service")
    (sm,) = by_kind("ServiceMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items() and svc["spec"]["clusterIP"] == "None"
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [kustomization()["namespace"]]
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"
        assert {r["targetLabel"] for r in ep["relabelings"]} == {"instance", "node"}
    (rb,) = by_kind("RoleBinding")
    (role,) = by_kind("Role")
    assert rb["roleRef"]["name"] == role["metadata"]["name"]
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in role["rules"])  # read-only


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax (systemd.syntax(7)): sections, repeated keys kept in order, '#' comments."""
    out: dict[str, dict[str, list[str]]] = {}
    sec = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            sec = out.setdefault(line.strip("[]"), {})
            continue
        k, _, v = line.partition("=")
        sec.setdefault(k.strip(), []).append(v.strip())
    return out


def test_relay_unit_starts_before_kubelet_and_runs_the_relay():
    u = parse_unit(SYSTEMD / "cri-resmgr-relay.service")
    assert "kubelet.service" in u["Unit"]["Before"][0].split()
    assert "containerd.service" in u["Unit"]["After"][0].split()
    assert "kubelet.service" in u["Install"]["RequiredBy"][0].split()
    argv = shlex.split(u["Service"]["ExecStart"][0])
    assert argv[0].endswith("/cri-resmgr")
    args = build_parser().parse_args(argv[1:])
    assert args.cmd == "relay" and str(args.config) == "/etc/cri-resmgr/relay.yaml"
    assert u["Service"]["Restart"] == ["always"]


def test_kubelet_dropin_points_at_the_relay_socket():
    d = parse_unit(SYSTEMD / "kubelet.service.d" / "20-cri-resmgr.conf")
    assert d["Unit"]["After"] == ["cri-resmgr-relay.service"] and d["Unit"]["Requires"] == ["cri-resmgr-relay.service"]
    env = dict(e.strip('"').split("=", 1) for e in d["Service"]["Environment"])
    flag = env["CRI_RESMGR_KUBELET_ARGS"]
    relay_cfg = build_config(yaml.safe_load((SYSTEMD / "relay.yaml").read_text()), env={})
    assert flag == f"--container-runtime-endpoint=unix://{relay_cfg.relay.socket}"
    assert relay_cfg.relay.socket == Config().relay.socket  # the default, as the README's walk-through says
    assert d["Service"]["ExecStart"][0] == ""  # resets kubeadm's ExecStart before replacing it
    assert d["Service"]["ExecStart"][1].split()[-1] == "$CRI_RESMGR_KUBELET_ARGS"  # last flag wins


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_relay_unit_passes_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart's binary exists: point it at this checkout's entry point.
    exe = shutil.which("cri-resmgr") or str(Path(__import__("sys").executable).parent / "cri-resmgr")
    unit = tmp_path / "cri-resmgr-relay.service"
    unit.write_text((SYSTEMD / "cri-resmgr-relay.service").read_text().replace("/usr/local/bin/cri-resmgr", exe))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    noise = [ln for ln in (r.stdout + r.stderr).splitlines()
             if ln.strip() and "kubelet.service" not in ln and "containerd.service" not in ln
             and "crio.service" not in ln and "not found" not in ln.lower()]
    assert r.returncode == 0 and not noise, r.stdout + r.stderr


def test_containerfile_builds_from_files_that_exist():
    text = (ROOT / "deploy" / "Containerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    froms = [ln for ln in lines if ln.startswith("FROM ")]
    assert len(froms) == 2 and "python:3.11" in text  # the supported Python
    for ln in lines:
        if ln.startswith("COPY ") and "--from=" not in ln:
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), src
    assert 'ENTRYPOINT ["cri-resmgr"]' in text and "libbpf1" in text
    # the wheel's build hook compiles the eBPF object; the image build fails rather than ship without it
    assert "CRI_RESMGR_REQUIRE_BPF=1 pip wheel" in text and "bpftool" not in text
    cmd = next(ln for ln in lines if ln.startswith("CMD "))
    assert build_parser().parse_args(yaml.safe_load(cmd[4:])).cmd == "run"
