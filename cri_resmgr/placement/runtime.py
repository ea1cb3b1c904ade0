"""What the engine needs from a container runtime, whatever the front end speaks (CRI, NRI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .estimate import Resources
from .model import State


class RuntimeCallError(Exception):
    """A runtime call that failed. ``not_found``: the container is gone; ``unavailable``: no answer."""

    def __init__(self, message: str, not_found: bool = False, unavailable: bool = False):
        super().__init__(message)
        self.not_found = not_found
        self.unavailable = unavailable


@dataclass(frozen=True)
class PodRecord:
    id: str
    name: str
    namespace: str
    uid: str
    cgroup_parent: str = ""
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    ready: bool = True
    created: float = 0.0


@dataclass(frozen=True)
class ContainerRecord:
    id: str
    pod_id: str
    name: str
    state: State
    annotations: dict[str, str] = field(default_factory=dict)
    resources: Resources | None = None  # None: the runtime did not say
    cgroup_parent: str = ""
    resources_blob: str = ""  # the front end's opaque record of the resources (CRI: hex of the message)
    created: float = 0.0


@dataclass(frozen=True)
class RuntimeSnapshot:
    pods: list[PodRecord]
    containers: list[ContainerRecord]


class RuntimePort(Protocol):
    def update_cpuset(self, container_id: str, cpus: str, mems: str, resources: str, timeout: float) -> str:
        """Apply a cpuset, keeping the other resources; returns the new opaque resources record.
        Raises RuntimeCallError."""
        ...

    def snapshot(self, timeout: float, known: frozenset[str]) -> RuntimeSnapshot:
        """Pods and containers as the runtime sees them now. Records whose id is in ``known`` (pods and
        containers the engine has) may leave out details (resources, cgroup parent). Raises RuntimeCallError."""
        ...

    def describe(self) -> str:
        ...
