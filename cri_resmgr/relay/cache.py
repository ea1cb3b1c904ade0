"""The relay's cache of pods and containers, persisted atomically under ``state_dir``.

The file is JSON, written to a temporary file in the same directory, fsynced and renamed over the old one
(rename(2) is atomic within a filesystem), so a crash leaves either the old or the new cache, never half.
At start the cache is loaded and then reconciled against the runtime, which stays the source of truth for
what exists; the cache adds what the runtime does not keep: the relay's placement decisions.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..sysfs import parse_cpulist

FILENAME = "relay-cache.json"
VERSION = 1

# Container placement kinds
EXCLUSIVE, SHARED, RESERVED, PINNED = "exclusive", "shared", "reserved", "pinned"
# Container states (CRI ContainerState, lower-cased)
CREATED, RUNNING, EXITED, UNKNOWN = "created", "running", "exited", "unknown"
LIVE_STATES = (CREATED, RUNNING)


@dataclass
class Pod:
    id: str
    name: str
    namespace: str
    uid: str
    qos_class: str
    cgroup_parent: str
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    state: str = "ready"  # ready, notready
    created: float = field(default_factory=time.time)


@dataclass
class Container:
    id: str
    pod_id: str
    name: str
    namespace: str
    pod_name: str
    pod_uid: str
    qos_class: str
    cgroup_parent: str
    annotations: dict[str, str] = field(default_factory=dict)  # effective: pod, container and per-container keys
    cpu_request_milli: int = 0
    cpu_limit_milli: int | None = None
    memory_limit_bytes: int | None = None
    placement: str = SHARED
    cpus: str = ""  # cpulist the relay applied
    mems: str = ""
    pinned_cpus: str = ""  # PINNED: the cpuset a move asked for (kept within the pool as it changes)
    avx512: bool = False
    reason: str = ""  # why the placement is what it is
    state: str = CREATED
    resources: str = ""  # LinuxContainerResources as last sent, hex of the serialized message
    created: float = field(default_factory=time.time)

    @property
    def cpu_set(self) -> frozenset[int]:
        return parse_cpulist(self.cpus) if self.cpus else frozenset()

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def cgroup_path(self) -> str:
        """The container's cgroup (cgroupfs driver: parent/id, as runc names it with containerd and CRI-O)."""
        return f"{self.cgroup_parent.rstrip('/')}/{self.id}" if self.cgroup_parent else ""


@dataclass
class Cache:
    pods: dict[str, Pod] = field(default_factory=dict)
    containers: dict[str, Container] = field(default_factory=dict)

    def exclusive_taken(self) -> dict[str, frozenset[int]]:
        return {c.id: c.cpu_set for c in self.containers.values() if c.placement == EXCLUSIVE and c.live}

    def find(self, pod_id: str, name: str) -> list[Container]:
        return [c for c in self.containers.values() if c.pod_id == pod_id and c.name == name]

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, "pods": [asdict(p) for p in self.pods.values()],
                           "containers": [asdict(c) for c in self.containers.values()]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Cache":
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"unsupported cache version {data.get('version') if isinstance(data, dict) else None!r}")
        pod_keys = {f.name for f in fields(Pod)}
        ctr_keys = {f.name for f in fields(Container)}
        pods = [Pod(**{k: v for k, v in p.items() if k in pod_keys}) for p in data.get("pods", [])]
        ctrs = [Container(**{k: v for k, v in c.items() if k in ctr_keys}) for c in data.get("containers", [])]
        return cls({p.id: p for p in pods}, {c.id: c for c in ctrs})


def save(cache_json: str, state_dir: Path) -> Path:
    path = Path(state_dir) / FILENAME
    tmp = path.with_name(f".{FILENAME}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, cache_json.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)  # the rename itself must survive a crash too
    finally:
        os.close(dfd)
    return path


def load(state_dir: Path) -> tuple[Cache, str | None]:
    """The saved cache, or an empty one and the reason it could not be read."""
    path = Path(state_dir) / FILENAME
    try:
        return Cache.from_json(path.read_text()), None
    except FileNotFoundError:
        return Cache(), None
    except (OSError, ValueError, TypeError) as e:
        return Cache(), f"ignoring unreadable cache {path}: {e}"
