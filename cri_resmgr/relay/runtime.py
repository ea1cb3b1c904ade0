"""The relay's own CRI client to the runtime (resync, reconcile, pool updates, moves, events), and the
engine's :class:`~cri_resmgr.placement.runtime.RuntimePort` over it (:class:`CriRuntime`).

Messages are the runtime.v1 stubs of ``container-runtime-interface-api`` (generated from
kubernetes/cri-api ``pkg/apis/runtime/v1/api.proto``). Calls always carry a timeout (a deadline), and the
channel reconnects with a short back-off so that a restarted runtime is found again within ~2 s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pbg

from ..placement.estimate import Resources
from ..placement.model import State
from ..placement.runtime import ContainerRecord, PodRecord, RuntimeCallError, RuntimeSnapshot

TESTED_RUNTIMES = ("containerd", "cri-o")

CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 16 << 20),  # kubelet's own limit for CRI responses
]

STATE_NAMES = {pb.CONTAINER_CREATED: State.CREATED, pb.CONTAINER_RUNNING: State.RUNNING,
               pb.CONTAINER_EXITED: State.EXITED, pb.CONTAINER_UNKNOWN: State.UNKNOWN}


def cri_methods() -> frozenset[str]:
    """Every RuntimeService and ImageService method path, from the stubs' descriptor."""
    out = set()
    for svc in pb.DESCRIPTOR.services_by_name.values():
        for m in svc.methods:
            out.add(f"/{svc.full_name}/{m.name}")
    return frozenset(out)


def untested_runtime(v: pb.VersionResponse) -> str | None:
    name = v.runtime_name.lower()
    if any(t in name for t in TESTED_RUNTIMES):
        return None
    return (f"runtime {v.runtime_name!r} {v.runtime_version} is not containerd or CRI-O "
            f"(set relay.allow_untested_runtimes to forward to it anyway)")


@dataclass(frozen=True)
class ContainerDetail:
    """What the runtime can tell about a container the relay did not see created."""

    resources: pb.LinuxContainerResources | None
    cgroup_parent: str


def _cgroups_path(info_json: str) -> str:
    # containerd's verbose status: info["runtimeSpec"]["linux"]["cgroupsPath"] (the OCI spec it ran).
    try:
        info = json.loads(info_json)
        return info.get("runtimeSpec", {}).get("linux", {}).get("cgroupsPath", "") or ""
    except (ValueError, AttributeError):
        return ""


class RuntimeClient:
    def __init__(self, socket_path: Path, timeout: float):
        self.path = Path(socket_path)
        self.timeout = timeout
        self.channel = grpc.insecure_channel(f"unix://{self.path}", options=CHANNEL_OPTIONS)
        self.rt = pbg.RuntimeServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def version(self, timeout: float | None = None) -> pb.VersionResponse:
        return self.rt.Version(pb.VersionRequest(version="v1"), timeout=timeout or self.timeout)

    def list_pods(self) -> list[pb.PodSandbox]:
        return list(self.rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=self.timeout).items)

    def list_containers(self) -> list[pb.Container]:
        return list(self.rt.ListContainers(pb.ListContainersRequest(), timeout=self.timeout).containers)

    def container_detail(self, container_id: str) -> ContainerDetail:
        r = self.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=container_id, verbose=True),
                                    timeout=self.timeout)
        res = r.status.resources.linux if r.status.HasField("resources") else None
        path = _cgroups_path(r.info.get("info", ""))
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        return ContainerDetail(res, parent)

    def pod_cgroup_parent(self, pod_id: str) -> str:
        r = self.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=True),
                                     timeout=self.timeout)
        path = _cgroups_path(r.info.get("info", ""))
        return path.rsplit("/", 1)[0] if "/" in path else ""

    def update_resources(self, container_id: str, res: pb.LinuxContainerResources) -> None:
        self.rt.UpdateContainerResources(pb.UpdateContainerResourcesRequest(container_id=container_id, linux=res),
                                         timeout=self.timeout)

    def events(self) -> Iterator[pb.ContainerEventResponse]:
        """GetContainerEvents (CRI v1, containerd >= 1.7, CRI-O >= 1.26); UNIMPLEMENTED elsewhere."""
        return self.rt.GetContainerEvents(pb.GetEventsRequest())


def resources_of(res: pb.LinuxContainerResources) -> Resources:
    return Resources(cpu_shares=res.cpu_shares, cpu_quota=res.cpu_quota, cpu_period=res.cpu_period,
                     memory_limit_bytes=res.memory_limit_in_bytes, cpuset_cpus=res.cpuset_cpus,
                     cpuset_mems=res.cpuset_mems)


def _call_error(e: grpc.RpcError, what: str) -> RuntimeCallError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return RuntimeCallError(f"{what}: {code.name}: {details}", not_found=code == grpc.StatusCode.NOT_FOUND,
                            unavailable=code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))


class CriRuntime:
    """The placement engine's runtime port over CRI. ``resources`` blobs are hex of LinuxContainerResources:
    an update resends the whole message (limits as last sent) with the new cpuset."""

    def __init__(self, client: RuntimeClient, before_snapshot: Callable[[float], object] | None = None):
        self.client = client
        self.before_snapshot = before_snapshot  # the relay checks the runtime's Version first

    def describe(self) -> str:
        return str(self.client.path)

    def update_cpuset(self, container_id: str, cpus: str, mems: str, resources: str, timeout: float) -> str:
        res = pb.LinuxContainerResources.FromString(bytes.fromhex(resources)) if resources else \
            pb.LinuxContainerResources()
        res.cpuset_cpus, res.cpuset_mems = cpus, mems
        try:
            self.client.rt.UpdateContainerResources(
                pb.UpdateContainerResourcesRequest(container_id=container_id, linux=res), timeout=timeout)
        except grpc.RpcError as e:
            raise _call_error(e, f"UpdateContainerResources {container_id[:12]}") from None
        return res.SerializeToString().hex()

    def snapshot(self, timeout: float, known: frozenset[str]) -> RuntimeSnapshot:
        c = self.client
        try:
            if self.before_snapshot is not None:
                self.before_snapshot(timeout)
            pods_pb = c.rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=timeout).items
            ctrs_pb = c.rt.ListContainers(pb.ListContainersRequest(), timeout=timeout).containers
        except grpc.RpcError as e:
            raise _call_error(e, "list") from None
        pods = []
        for p in pods_pb:
            parent = ""
            if p.id not in known:
                try:
                    parent = c.pod_cgroup_parent(p.id)
                except grpc.RpcError:
                    parent = ""
            pods.append(PodRecord(id=p.id, name=p.metadata.name, namespace=p.metadata.namespace, uid=p.metadata.uid,
                                  cgroup_parent=parent, annotations=dict(p.annotations), labels=dict(p.labels),
                                  ready=p.state == pb.SANDBOX_READY, created=p.created_at / 1e9))
        ctrs = []
        for it in ctrs_pb:
            res: Resources | None = None
            parent, blob = "", ""
            if it.id not in known:
                try:
                    d = c.container_detail(it.id)
                except grpc.RpcError:
                    continue  # gone meanwhile, or not answerable now: seen at the next reconcile
                if d.resources is not None:
                    res, blob = resources_of(d.resources), d.resources.SerializeToString().hex()
                parent = d.cgroup_parent
            ctrs.append(ContainerRecord(id=it.id, pod_id=it.pod_sandbox_id, name=it.metadata.name,
                                        state=STATE_NAMES.get(it.state, State.UNKNOWN),
                                        annotations=dict(it.annotations), resources=res, cgroup_parent=parent,
                                        resources_blob=blob, created=it.created_at / 1e9))
        return RuntimeSnapshot(pods, ctrs)
