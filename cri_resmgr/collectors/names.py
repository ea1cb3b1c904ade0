"""Pod and container names from the container runtime, for the Kubernetes labels of container series.

The cgroup path carries the container id, the pod uid and the QoS class, not names. The runtime knows
them: kubelet labels every container it creates with ``io.kubernetes.pod.name``,
``io.kubernetes.pod.namespace`` and ``io.kubernetes.container.name`` (kubernetes pkg/kubelet/types/labels.go),
and CRI's ``ContainerMetadata.name`` / ``PodSandboxMetadata.{name,namespace}`` hold the same
(cri-api pkg/apis/runtime/v1/api.proto). This asks the runtime's CRI socket (``ListContainers`` and
``ListPodSandbox``) at most every ``refresh_seconds``; a failing runtime keeps the last good answer and
says why in :attr:`RuntimeNames.error`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POD_NAME = "io.kubernetes.pod.name"
POD_NAMESPACE = "io.kubernetes.pod.namespace"
CONTAINER_NAME = "io.kubernetes.container.name"


# Annotations of this domain (pod or container) travel with the names, e.g. what the RDT collector ranks by;
# the others are not kept (a node's annotations can be large).
ANNOTATION_DOMAIN = "cri-resource-manager.intel.com"


@dataclass(frozen=True)
class ContainerNames:
    namespace: str
    pod: str
    container: str
    annotations: tuple[tuple[str, str], ...] = ()  # the pod's and the container's, of ANNOTATION_DOMAIN


def _ours(*maps) -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {}
    for m in maps:
        for k, v in (m or {}).items():
            if ANNOTATION_DOMAIN in k:
                out[k] = v
    return tuple(sorted(out.items()))


def names_from(containers: Iterable, sandboxes: Iterable) -> dict[str, ContainerNames]:
    """Map container id → names from CRI ``Container`` and ``PodSandbox`` messages: kubelet's labels first,
    the CRI metadata where a label is missing."""
    pods = {s.id: s for s in sandboxes}
    out = {}
    for c in containers:
        sb = pods.get(c.pod_sandbox_id)
        labels = dict(c.labels)
        ns = labels.get(POD_NAMESPACE) or (sb.metadata.namespace if sb is not None else "")
        pod = labels.get(POD_NAME) or (sb.metadata.name if sb is not None else "")
        name = labels.get(CONTAINER_NAME) or c.metadata.name
        out[c.id] = ContainerNames(ns, pod, name, _ours(sb.annotations if sb is not None else {}, c.annotations))
    return out


def sandbox_names(sandboxes: Iterable) -> dict[str, ContainerNames]:
    """A sandbox's own (pause) container has a cgroup but is not in ListContainers: it gets its pod's names
    with an empty container name, so that it does not look unknown on every cycle."""
    return {s.id: ContainerNames(s.metadata.namespace, s.metadata.name, "") for s in sandboxes}


class RuntimeNames:
    def __init__(self, socket_path: Path, refresh_seconds: float = 10.0, timeout_seconds: float = 2.0,
                 clock=time.monotonic):
        self.socket_path = Path(socket_path)
        self.refresh_seconds = refresh_seconds
        self.timeout_seconds = timeout_seconds
        self.clock = clock
        self.error: str | None = None
        self._names: dict[str, ContainerNames] = {}
        self._at: float | None = None
        self._asked: set[str] = set()
        self._client: Any = None  # RuntimeServiceStub, made on first use

    def _stub(self):
        if self._client is None:
            # Imported here: grpc and the CRI stubs are only loaded on nodes where a runtime socket exists.
            import grpc
            from cri_api.v1 import api_pb2_grpc as pbg

            self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
            self._client = pbg.RuntimeServiceStub(self._channel)
        return self._client

    def names(self, known_ids: Iterable[str] = ()) -> dict[str, ContainerNames]:
        """Cached names; refreshed when older than ``refresh_seconds`` or when a container id is unknown
        (a new container gets its names in the same cycle it first appears)."""
        known_ids = list(known_ids)
        now = self.clock()
        stale = self._at is None or now - self._at >= self.refresh_seconds
        # An id the runtime did not know at the last refresh (another runtime's container) waits for the
        # periodic refresh; only ids never asked about trigger an early one.
        unknown = any(cid not in self._names and cid not in self._asked for cid in known_ids)
        if unknown:
            self._asked.update(known_ids)
        if not (stale or (unknown and now - (self._at or 0) >= 1.0)):
            return self._names
        try:
            present = self.socket_path.exists()
        except OSError as e:  # e.g. EACCES: /run/containerd is 0700 and the agent is not root
            self.error = (f"cannot reach runtime socket {self.socket_path}: {e.strerror}; "
                          "container and pod names unknown")
            self._at = now
            return self._names
        if present:
            self._refresh(now)
        else:
            self.error = f"no runtime socket at {self.socket_path}: container and pod names unknown"
            self._at = now
        return self._names

    def _refresh(self, now: float) -> None:
        import grpc
        from cri_api.v1 import api_pb2 as pb

        try:
            stub = self._stub()
            cs = stub.ListContainers(pb.ListContainersRequest(), timeout=self.timeout_seconds).containers
            ps = stub.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=self.timeout_seconds).items
        except grpc.RpcError as e:
            msg = f"runtime {self.socket_path}: {e.code().name}: {e.details()}; keeping the last names"
            if msg != self.error:
                log.warning("%s", msg)
            self.error = msg
            self._at = now
            return
        self._names = {**sandbox_names(ps), **names_from(cs, ps)}
        if len(self._asked) > 4 * max(64, len(self._names)):
            self._asked.clear()  # churn: keep the set bounded (forgotten ids may trigger one early refresh)
        self._at = now
        self.error = None

    def close(self) -> None:
        if self._client is not None:
            self._channel.close()
            self._client = None
