"""Typed records the relay hands across process boundaries (control socket, moves log)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class MoveRequest(BaseModel):
    container_id: str = Field(min_length=1)
    cpus: str = Field(min_length=1, description="cpulist to run on")
    mems: str | None = Field(None, description="NUMA nodes; default: those of the CPUs")
    who: str = "unknown"
    why: str = ""


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


class RelayState(BaseModel):
    runtime_up: bool
    runtime: str = ""  # name and version from Version
    problem: str | None = None  # why calls are refused, if they are
    shared_pool: str
    reserved: str
    exclusive: dict[str, str]  # container id -> cpus
    containers: list[ContainerView]
    pods: int
