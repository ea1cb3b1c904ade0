"""NRI messages to the placement engine's records and back (pure functions, no I/O).

NRI hands the plugin the container's OCI resources (``LinuxResources``: cpu shares/quota/period, cpuset,
memory limit) as the runtime will apply them, which are kubelet's conversions of requests and limits;
:mod:`cri_resmgr.placement.estimate` recovers the requests from them exactly as for CRI.
"""

from __future__ import annotations

from ..placement.estimate import Resources
from ..placement.model import State
from ..placement.runtime import ContainerRecord, PodRecord
from .proto import nri_pb2 as api

STATES = {api.CONTAINER_CREATED: State.CREATED, api.CONTAINER_RUNNING: State.RUNNING,
          api.CONTAINER_PAUSED: State.RUNNING, api.CONTAINER_STOPPED: State.EXITED,
          api.CONTAINER_UNKNOWN: State.UNKNOWN}


def resources_of(res: api.LinuxResources) -> Resources:
    cpu, mem = res.cpu, res.memory
    return Resources(cpu_shares=cpu.shares.value, cpu_quota=cpu.quota.value, cpu_period=cpu.period.value,
                     memory_limit_bytes=max(0, mem.limit.value), cpuset_cpus=cpu.cpus, cpuset_mems=cpu.mems)


def pod_record(pod: api.PodSandbox, ready: bool = True) -> PodRecord:
    return PodRecord(id=pod.id, name=pod.name, namespace=pod.namespace, uid=pod.uid,
                     cgroup_parent=pod.linux.cgroup_parent, annotations=dict(pod.annotations),
                     labels=dict(pod.labels), ready=ready)


def blob_of(res: api.LinuxResources) -> str:
    """The engine's opaque record of a container's resources: the serialized message, hex."""
    return res.SerializeToString().hex()


def container_record(ctr: api.Container, pod: api.PodSandbox | None, state: State | None = None) -> ContainerRecord:
    res = ctr.linux.resources
    # containerd puts the container's cgroup under the pod's (cgroupfs driver: <parent>/<id>)
    parent = pod.linux.cgroup_parent if pod is not None else ""
    if not parent and "/" in ctr.linux.cgroups_path and ":" not in ctr.linux.cgroups_path:
        parent = ctr.linux.cgroups_path.rsplit("/", 1)[0]
    return ContainerRecord(id=ctr.id, pod_id=ctr.pod_sandbox_id, name=ctr.name,
                           state=state or STATES.get(ctr.state, State.UNKNOWN), annotations=dict(ctr.annotations),
                           resources=resources_of(res) if ctr.linux.HasField("resources") else None,
                           cgroup_parent=parent, resources_blob=blob_of(res))


def cpuset_update(container_id: str, cpus: str, mems: str, blob: str = "") -> api.ContainerUpdate:
    """An update that sets the cpuset and keeps the other resources of ``blob`` (as the runtime last had them):
    containerd applies an update's resources as a whole, so the rest must travel with it."""
    res = api.LinuxResources.FromString(bytes.fromhex(blob)) if blob else api.LinuxResources()
    res.cpu.cpus = cpus
    if mems:
        res.cpu.mems = mems
    u = api.ContainerUpdate(container_id=container_id)
    u.linux.resources.CopyFrom(res)
    return u


def events_mask(events: list[int]) -> int:
    """ConfigureResponse.events: bit (event - 1) for each event (containerd/nri pkg/api/event.go)."""
    mask = 0
    for e in events:
        mask |= 1 << (e - 1)
    return mask
