"""Typed records the engine hands across process boundaries (the relay's control socket, the moves log)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class MoveRequest(BaseModel):
    container_id: str = Field(min_length=1)
    cpus: str = Field(min_length=1, description="cpulist to run on")
    mems: str | None = Field(None, description="NUMA nodes; default: those of the CPUs")
    who: str = "unknown"
    why: str = ""
    gain_by_term: dict[str, float] = Field(default_factory=dict, description="rebalancer: term -> predicted gain")
    separates: list[dict[str, str | float]] = Field(
        default_factory=list, description="rebalancer: victim/antagonist pairs the move separates")


class MoveRecord(BaseModel):
    time: float
    container_id: str
    container: str = ""
    pod: str = ""
    namespace: str = ""
    who: str
    why: str
    from_cpus: str
    to_cpus: str
    from_mems: str
    to_mems: str
    result: Literal["applied", "refused", "failed"]
    error: str = ""
    gain_by_term: dict[str, float] = Field(default_factory=dict)
    separates: list[dict[str, str | float]] = Field(default_factory=list)


class ContainerView(BaseModel):
    id: str
    pod_id: str
    name: str
    pod: str
    namespace: str
    pod_uid: str
    qos_class: str
    state: str
    placement: str
    cpus: str
    mems: str
    cpu_request_milli: int
    cpu_limit_milli: int | None
    memory_limit_bytes: int | None
    annotations: dict[str, str]
    cgroup_path: str
    reason: str
    controls: dict[str, str] = Field(default_factory=dict)  # resource controller -> class applied
    control_errors: dict[str, str] = Field(default_factory=dict)  # resource controller -> why it failed


class ThreadView(BaseModel):
    name: str
    alive: bool
    restarts: int
    last_error: str = ""


class ViolationView(BaseModel):
    rule: str
    container_id: str
    detail: str
    other_id: str = ""


class InvariantView(BaseModel):
    time: float = 0.0  # of the last check (0: none yet)
    checked: int = 0  # running containers whose kernel cpuset was read
    repaired: int = 0
    violations_total: int = 0
    repairs_total: int = 0
    violations: list[ViolationView] = Field(default_factory=list)


class RelayState(BaseModel):
    runtime_up: bool
    runtime: str = ""  # name and version from Version
    problem: str | None = None  # why calls are refused, if they are
    shared_pool: str
    reserved: str
    exclusive: dict[str, str]  # container id -> cpus
    containers: list[ContainerView]
    pods: int
    pending: int = 0  # reservations of creates and resizes the runtime has not answered yet
    threads: list[ThreadView] = Field(default_factory=list)
    invariants: InvariantView = Field(default_factory=InvariantView)
    counters: dict[str, float] = Field(default_factory=dict)
