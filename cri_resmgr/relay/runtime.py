"""The relay's own CRI client to the runtime (resync, reconcile, pool updates, moves, events).

Messages are the runtime.v1 stubs of ``container-runtime-interface-api`` (generated from
kubernetes/cri-api ``pkg/apis/runtime/v1/api.proto``). Calls always carry a timeout, and the channel
reconnects with a short back-off so that a restarted runtime is found again within ~2 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pbg

TESTED_RUNTIMES = ("containerd", "cri-o")

CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 16 << 20),  # kubelet's own limit for CRI responses
]

STATE_NAMES = {pb.CONTAINER_CREATED: "created", pb.CONTAINER_RUNNING: "running", pb.CONTAINER_EXITED: "exited",
               pb.CONTAINER_UNKNOWN: "unknown"}


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
