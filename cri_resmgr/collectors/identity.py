"""Container identity from a cgroup path.

Kubernetes lays containers out as ``<kubepods>/<qos>/<pod>/<container>``; the spelling depends on the
cgroup driver and the runtime (kubelet pkg/kubelet/cm/cgroup_manager_linux.go; containerd and CRI-O
name the leaf):

- cgroupfs driver: ``kubepods/burstable/pod<uid>/<id>`` (containerd, runc) or ``.../crio-<id>`` (CRI-O);
  Guaranteed pods sit directly under ``kubepods``.
- systemd driver: ``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/``
  then ``cri-containerd-<id>.scope``, ``crio-<id>.scope`` or ``docker-<id>.scope``.

CRI-O also creates ``crio-conmon-<id>.scope`` for its monitor process; that is not a container.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_POD = re.compile(
    r"(?:^|[-/])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$"
)
_CONTAINER = re.compile(r"^(?:(cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?$")
_QOS = {"burstable": "Burstable", "besteffort": "BestEffort"}
_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker", None: "containerd"}


@dataclass(frozen=True)
class ContainerIdentity:
    container_id: str
    pod_uid: str
    qos_class: str  # Guaranteed, Burstable, BestEffort, or "" when not a Kubernetes path
    runtime: str
    cgroup_path: str  # relative to the hierarchy root, with a leading slash
    name: str = ""  # container name, when known (extra cgroups, CRI metadata)
    pod: str = ""
    namespace: str = ""
    annotations: tuple[tuple[str, str], ...] = ()  # cri-resource-manager ones of the pod and container (CRI)

    def annotated(self, domain: str) -> str | None:
        """The value of ``<domain>/container.<name>``, else ``<domain>/pod`` (cri-resource-manager's
        convention: a pod annotation, per container or for the whole pod); None when neither is set."""
        ann = dict(self.annotations)
        v = ann.get(f"{domain}/container.{self.name}") if self.name else None
        return v if v is not None else ann.get(f"{domain}/pod")

    def labels(self) -> dict[str, str]:
        return {
            "namespace": self.namespace,
            "pod": self.pod,
            "container": self.name,
            "container_id": self.container_id,
            "pod_uid": self.pod_uid,
            "qos_class": self.qos_class,
        }


def parse_container_path(path: str) -> ContainerIdentity | None:
    """Return the identity for a container cgroup path, or None if the path is not a container's."""
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) < 2:
        return None
    m = _CONTAINER.match(parts[-1])
    if not m or "conmon" in parts[-1]:
        return None
    pm = _POD.search(parts[-2])
    if not pm:
        return None
    if not any(p.startswith("kubepods") or "-kubepods" in p for p in parts[:-2]):
        return None
    uid = pm.group(1).replace("_", "-")
    qos = "Guaranteed"
    for p in parts[:-1]:
        low = p.lower()
        for key, cls in _QOS.items():
            if low == key or low.startswith(f"kubepods-{key}") or f"-{key}" in low.removesuffix(".slice"):
                qos = cls
    return ContainerIdentity(
        container_id=m.group(2),
        pod_uid=uid,
        qos_class=qos,
        runtime=_RUNTIMES[m.group(1)],
        cgroup_path="/" + "/".join(parts),
    )


def short_name(ident: ContainerIdentity) -> str:
    """``namespace/pod/container`` when names are known, else the id's first 12 characters (for reasons)."""
    if ident.namespace or ident.pod or ident.name:
        return f"{ident.namespace}/{ident.pod}/{ident.name or ident.container_id[:12]}"
    return ident.container_id[:12]


def is_container_dir(name: str) -> bool:
    m = _CONTAINER.match(name)
    return bool(m) and "conmon" not in name
