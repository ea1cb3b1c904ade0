"""The hook point for resource controllers (RDT, block I/O, RT: cri_resmgr/placement/controllers/).

The engine calls every registered :class:`Controller` on its own ``controllers`` thread, in event order,
never under its lock. An exception is logged and counted and never changes placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .model import Container, Kind, Pod


@dataclass(frozen=True)
class ContainerContext:
    id: str
    name: str
    pod_id: str
    pod_name: str
    pod_namespace: str
    pod_uid: str
    annotations: Mapping[str, str]  # pod annotations overlaid by the container's own (all keys)
    effective: Mapping[str, str]  # cri-resmgr.io/* resolved (pod, container, <key>.container.<name>)
    qos_class: str  # Guaranteed, Burstable, BestEffort, or "" when unknown
    cgroup_parent: str
    cgroup_path: str  # "" when unknown (cgroupfs driver: parent/id)
    cpus: str
    mems: str
    kind: Kind

    @classmethod
    def of(cls, c: Container, pod: Pod | None = None) -> ContainerContext:
        raw = {**(pod.annotations if pod is not None else {}), **c.raw_annotations}
        return cls(id=c.id, name=c.name, pod_id=c.pod_id, pod_name=c.pod_name, pod_namespace=c.namespace,
                   pod_uid=c.pod_uid, annotations=raw, effective=dict(c.annotations), qos_class=c.qos_class,
                   cgroup_parent=c.cgroup_parent, cgroup_path=c.cgroup_path, cpus=c.cpus, mems=c.mems,
                   kind=c.placement)


class Controller(Protocol):
    name: str

    def started(self, ctx: ContainerContext) -> None:
        """The container started: enforce."""

    def adopted(self, ctx: ContainerContext) -> None:
        """A running container found at reconcile/Synchronize: enforce."""

    def stopped(self, ctx: ContainerContext) -> None:
        """Stopped, exited (crash, OOM) or removed: release. Called once per container."""

    def reload(self, running: Sequence[ContainerContext]) -> None:
        """Configuration reloaded: re-enforce for every running container."""
