"""Container identity from a cgroup path.

Kubernetes lays containers out as ``<kubepods>/<qos>/<pod>/<container>``; the spelling depends on the
cgroup driver and the runtime (kubelet pkg/kubelet/cm/cgroup_manager_linux.go; containerd and CRI-O
name the leaf):

- cgroupfs driver: ``kubepods/burstable/pod<uid>/<id>`` (containerd, runc) or ``.../crio-<id>`` (CRI-O);
  Guaranteed pods sit directly under ``kubepods``.
- systemd driver: ``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/``
  then ``cri-containerd-<id>.scope``, ``crio-<id>.scope`` or ``docker-<id>.scope``.

CRI-O also creates ``crio-conmon-<id>.scope`` for its monitor process; that is not a container.

One object per container path: the collectors that discover containers (the cgroup collector in its hierarchy,
the AVX-512 one in the v2 tree and from its cgroup-id scan) parse the same relative paths, and
:func:`parse_container_path` hands each the identity another already holds. With the label set each
identity keeps (:meth:`ContainerIdentity.labels`), a container's identity and labels are held once, not once
per collector (docs/hardware-collectors.md, "Fixed costs and one identity per container").
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass, field

from ..store import LabelSet

_POD = re.compile(
    r"(?:^|[-/])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$"
)
_CONTAINER = re.compile(r"^(?:(cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?$")
_QOS = {"burstable": "Burstable", "besteffort": "BestEffort"}
_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker", None: "containerd"}


@dataclass(frozen=True, slots=True, weakref_slot=True)
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
    _labels: LabelSet | None = field(default=None, init=False, repr=False, compare=False)

    def annotated(self, domain: str) -> str | None:
        """The value of ``<domain>/container.<name>``, else ``<domain>/pod`` (cri-resource-manager's
        convention: a pod annotation, per container or for the whole pod); None when neither is set."""
        ann = dict(self.annotations)
        v = ann.get(f"{domain}/container.{self.name}") if self.name else None
        return v if v is not None else ann.get(f"{domain}/pod")

    def labels(self) -> LabelSet:
        """The container's labels, one set per identity for all its series and collectors (a mapping: ``{**l,
        ...}`` adds to a copy)."""
        got = self._labels
        if got is None:
            got = LabelSet({"namespace": self.namespace, "pod": self.pod, "container": self.name,
                            "container_id": self.container_id, "pod_uid": self.pod_uid, "qos_class": self.qos_class})
            object.__setattr__(self, "_labels", got)  # (frozen: set once, by whichever caller asks first)
        return got


_BY_PATH: weakref.WeakValueDictionary[str, ContainerIdentity] = weakref.WeakValueDictionary()
_BY_PATH_LOCK = threading.Lock()  # (the collectors discover from their own threads)


def parse_container_path(path: str) -> ContainerIdentity | None:
    """Return the identity for a container cgroup path, or None if the path is not a container's."""
    parts = [p for p in path.strip("/").split("/") if p]
    if len(parts) < 2:
        return None
    cgroup_path = "/" + "/".join(parts)
    got = _BY_PATH.get(cgroup_path)
    if got is not None:
        return got
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
    ident = ContainerIdentity(
        container_id=m.group(2),
        pod_uid=uid,
        qos_class=qos,
        runtime=_RUNTIMES[m.group(1)],
        cgroup_path=cgroup_path,
    )
    with _BY_PATH_LOCK:
        return _BY_PATH.setdefault(cgroup_path, ident)


def short_name(ident: ContainerIdentity) -> str:
    """``namespace/pod/container`` when names are known, else the id's first 12 characters (for reasons)."""
    if ident.namespace or ident.pod or ident.name:
        return f"{ident.namespace}/{ident.pod}/{ident.name or ident.container_id[:12]}"
    return ident.container_id[:12]


def is_container_dir(name: str) -> bool:
    m = _CONTAINER.match(name)
    return bool(m) and "conmon" not in name
