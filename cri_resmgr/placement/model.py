"""The engine's records of pods and containers, and their JSON form (the cache file).

The runtime stays the source of truth for what exists; the cache adds what the runtime does not keep: the
engine's placement decisions. :func:`Cache.from_json` validates the shape of every field, so a file that is
valid JSON of the wrong shape is refused like an unreadable one (see :mod:`.persist`). The containers are
held in a :class:`ContainerTable`, a dict that keeps the indexes the create path needs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import orjson

from ..sysfs import parse_cpulist

VERSION = 1


class Kind(StrEnum):
    """How a container's CPUs were chosen."""

    EXCLUSIVE = "exclusive"
    SHARED = "shared"
    RESERVED = "reserved"
    PINNED = "pinned"  # moved by the rebalancer within the shared pool


class State(StrEnum):
    """CRI ContainerState, lower-cased. UNKNOWN is not EXITED: containerd reports it for containers it has
    not loaded yet after its own restart, and those keep running and pinned."""

    CREATED = "created"
    RUNNING = "running"
    EXITED = "exited"
    UNKNOWN = "unknown"


HOLDING_STATES = (State.CREATED, State.RUNNING, State.UNKNOWN)  # states in which a container holds its CPUs


def moves_on(old: State, new: State) -> bool:
    """Whether a runtime's report of ``new`` changes a container the books have in ``old``: states only move
    forward (created, running, exited; unknown in between until the runtime knows again), so an older report
    (a list taken before a start or an exit the books saw) changes nothing. Exited is final."""
    if old == new or old == State.EXITED:
        return False
    return not (old == State.RUNNING and new == State.CREATED)


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
    raw_annotations: dict[str, str] = field(default_factory=dict)  # the container's own, all keys (pod's: Pod)
    cpu_request_milli: int = 0
    cpu_limit_milli: int | None = None
    memory_limit_bytes: int | None = None
    placement: Kind = Kind.SHARED
    cpus: str = ""  # cpulist the runtime applied (as far as the engine knows)
    mems: str = ""
    pinned_cpus: str = ""  # PINNED: the cpuset a move asked for (kept within the pool as it changes)
    avx512: bool = False
    reason: str = ""  # why the placement is what it is
    state: State = State.CREATED
    resources: str = ""  # the front end's opaque record of the resources last sent (CRI: hex of the message)
    created: float = field(default_factory=time.time)

    @property
    def cpu_set(self) -> frozenset[int]:
        return cpu_set_of(self.cpus)

    @property
    def live(self) -> bool:
        """Holds its CPUs: created, running, or unknown (not known to have exited)."""
        return self.state in HOLDING_STATES

    @property
    def cgroup_path(self) -> str:
        """The container's cgroup (cgroupfs driver: parent/id, as runc names it with containerd and CRI-O)."""
        return f"{self.cgroup_parent.rstrip('/')}/{self.id}" if self.cgroup_parent else ""


class _Watched:
    """A Container field whose changes the table holding the container hears of (its indexes depend on it).
    Only ``__set__``: reads go straight to the instance's ``__dict__`` (a data descriptor without ``__get__``),
    and the value lives there under the field's own name (orjson, ``dataclasses`` see a plain field)."""

    def __init__(self, name: str):
        self.name = name

    def __set__(self, obj: Container, value: Any) -> None:
        d = obj.__dict__
        d[self.name] = value
        for slot in d.get("_table_slots", ()):  # the ContainerTables holding obj
            slot[0].changed(obj, slot)


for _name in ("placement", "state", "cpus"):
    setattr(Container, _name, _Watched(_name))


@functools.lru_cache(maxsize=1024)
def cpu_set_of(cpus: str) -> frozenset[int]:
    """A cpulist's CPUs; cached: hundreds of containers share the few cpulists of a node's pools."""
    return parse_cpulist(cpus) if cpus else frozenset()


def _check(record: Any, types: dict[str, tuple[type, ...]], what: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{what}: expected an object, got {type(record).__name__}")
    out: dict[str, Any] = {}
    for k, v in record.items():
        want = types.get(k)
        if want is None:
            continue  # a field of a newer version: dropped
        if not isinstance(v, want) or (isinstance(v, bool) and bool not in want):
            raise ValueError(f"{what}.{k}: expected {'/'.join(t.__name__ for t in want)}, got {type(v).__name__}")
        if isinstance(v, dict) and not all(isinstance(a, str) and isinstance(b, str) for a, b in v.items()):
            raise ValueError(f"{what}.{k}: expected a string map")
        out[k] = v
    return out


def _field_types(cls: type) -> dict[str, tuple[type, ...]]:
    out: dict[str, tuple[type, ...]] = {}
    for f in fields(cls):
        t = str(f.type)
        if t.startswith("dict"):
            out[f.name] = (dict,)
        elif t.startswith("int | None"):
            out[f.name] = (int, type(None))
        elif t == "int":
            out[f.name] = (int,)
        elif t == "float":
            out[f.name] = (int, float)
        elif t == "bool":
            out[f.name] = (bool,)
        else:
            out[f.name] = (str,)
    return out


_POD_TYPES = _field_types(Pod)
_CTR_TYPES = _field_types(Container)

# -- the container table ---------------------------------------------------------------------------------
MEMO_ENTRIES = 256  # distinct (namespace, pod, annotation) answers kept; beyond it they are all dropped


def pod_ref_key(namespace: str, pod_name: str, name: str) -> str:
    """Index key of container ``name`` of pod ``pod_name`` (an annotation's ``pod/name``)."""
    return f"p\0{namespace}\0{pod_name}\0{name}"


def same_pod_key(namespace: str, pod_id: str, name: str) -> str:
    """Index key of container ``name`` of the pod with id ``pod_id`` (an annotation's bare ``name``)."""
    return f"i\0{namespace}\0{pod_id}\0{name}"


def keys_of(c: Container) -> tuple[str, str]:
    return pod_ref_key(c.namespace, c.pod_name, c.name), same_pod_key(c.namespace, c.pod_id, c.name)


@dataclass
class _Answer:
    texts: frozenset[str]  # the cpulists of the live containers named


class ContainerTable(dict[str, Container]):
    """The engine's container table (``Cache.containers``): a dict id -> Container that keeps its own indexes.

    The create path asks two questions of the books that a plain dict answers only by walking every container:

    - which CPUs do the containers an (anti-)affinity annotation names hold (:meth:`ContainerTable.cpus_named`)?
      A pod's list may name a thousand containers; the table indexes containers by name, answers from the
      names listed, and remembers each answer until one of the containers it depends on is added, removed, or
      changes state or cpuset;
    - which containers hold exclusive CPUs (:meth:`ContainerTable.exclusive`)?

    Kept in step by the dict's own mutators (every way of adding or removing an entry) and by the container's
    watched fields (``placement``, ``state``, ``cpus``: :class:`_Watched` tells the table holding the
    container of each change), so no caller has to remember to. What the indexes rely on: a container's id, name,
    pod and namespace do not change while it is in the table (the engine sets them before inserting it).
    Tested against the brute-force answers on random states (tests/test_placement_index.py).
    """

    def __init__(self, items: Mapping[str, Container] | Iterable[tuple[str, Container]] = ()):
        super().__init__()
        self._by_key: dict[str, dict[str, Container]] = {}
        self._exclusive: dict[str, Container] = {}
        self._answers: dict[tuple[str, str, frozenset[str]], _Answer] = {}
        self._dependents: dict[str, set[tuple[str, str, frozenset[str]]]] = {}  # key -> answers using it
        self.update(items)

    # -- the dict's mutators, each keeping the indexes ---------------------------------------------------
    def __setitem__(self, cid: str, c: Container) -> None:
        old = dict.get(self, cid)
        if old is not None:
            self._unindex(cid, old)
        dict.__setitem__(self, cid, c)
        self._index(cid, c)

    def __delitem__(self, cid: str) -> None:
        c = dict.pop(self, cid)
        self._unindex(cid, c)

    _MISSING: Any = object()

    def pop(self, cid: str, default: Any = _MISSING) -> Any:
        if dict.__contains__(self, cid):
            c = dict.pop(self, cid)
            self._unindex(cid, c)
            return c
        if default is ContainerTable._MISSING:
            raise KeyError(cid)
        return default

    def popitem(self) -> tuple[str, Container]:
        cid, c = dict.popitem(self)
        self._unindex(cid, c)
        return cid, c

    def setdefault(self, cid: str, default: Container) -> Container:
        if not dict.__contains__(self, cid):
            self[cid] = default
        return dict.__getitem__(self, cid)

    def update(self, *args: Any, **kw: Any) -> None:
        for cid, c in dict(*args, **kw).items():
            self[cid] = c

    def __ior__(self, other: Any) -> ContainerTable:  # type: ignore[override, misc]
        self.update(other)
        return self

    def clear(self) -> None:
        dict.clear(self)
        self._by_key.clear()
        self._exclusive.clear()
        self._answers.clear()
        self._dependents.clear()

    def copy(self) -> dict[str, Container]:
        return dict(self)

    # -- indexes -----------------------------------------------------------------------------------------
    def _index(self, cid: str, c: Container) -> None:
        keys = keys_of(c)
        c.__dict__.setdefault("_table_slots", []).append((self, cid, keys))
        for k in keys:
            self._by_key.setdefault(k, {})[cid] = c
            self._forget(k)
        if c.placement == Kind.EXCLUSIVE:
            self._exclusive[cid] = c

    def _unindex(self, cid: str, c: Container) -> None:
        slots = c.__dict__.get("_table_slots", [])
        mine = next((s for s in slots if s[0] is self and s[1] == cid), None)
        if mine is not None:
            slots.remove(mine)
        for k in mine[2] if mine is not None else keys_of(c):
            group = self._by_key.get(k)
            if group is not None:
                group.pop(cid, None)
                if not group:
                    del self._by_key[k]
            self._forget(k)
        self._exclusive.pop(cid, None)

    def _forget(self, key: str) -> None:
        deps = self._dependents.pop(key, None)
        if deps:
            for a in deps:
                self._answers.pop(a, None)

    def changed(self, c: Container, slot: tuple[ContainerTable, str, tuple[str, str]]) -> None:
        """A watched field of ``c`` (in this table under ``slot[1]``) was set."""
        cid, keys = slot[1], slot[2]
        if dict.get(self, cid) is not c:
            return
        for k in keys:
            self._forget(k)
        if c.placement == Kind.EXCLUSIVE:
            self._exclusive[cid] = c
        else:
            self._exclusive.pop(cid, None)

    # -- queries -----------------------------------------------------------------------------------------
    def exclusive(self) -> Iterator[Container]:
        """The live containers with exclusive CPUs."""
        return (c for c in list(self._exclusive.values()) if c.state in HOLDING_STATES)

    def cpus_named(self, namespace: str, pod_id: str, refs: Mapping[str, frozenset[str]]) -> frozenset[str]:
        """The cpulists held by the live containers that ``refs`` names (container name -> pod names, "" for
        the pod ``pod_id``; see :func:`~.annotations.container_refs`) in ``namespace``. O(names) the first
        time, then O(1) until one of the containers named is added, removed, or changes state or cpuset."""
        wanted = self._wanted(namespace, pod_id, refs)
        akey = (namespace, pod_id, wanted)
        a = self._answers.get(akey)
        if a is not None:
            return a.texts
        texts = frozenset(c.cpus for k in self._by_key.keys() & wanted for c in self._by_key[k].values()
                          if c.state in HOLDING_STATES)
        if len(self._answers) >= MEMO_ENTRIES:
            self._answers.clear()
            self._dependents.clear()
        for k in wanted:
            self._dependents.setdefault(k, set()).add(akey)
        self._answers[akey] = _Answer(texts)
        return texts

    _wanted_cache: dict[tuple[str, str, int], tuple[Mapping[str, frozenset[str]], frozenset[str]]] = {}

    @staticmethod
    def _wanted(namespace: str, pod_id: str, refs: Mapping[str, frozenset[str]]) -> frozenset[str]:
        """The index keys ``refs`` names (remembered for the last few ``refs`` objects seen: every container of
        a pod repeats its pod's list, and :func:`~.annotations.container_refs` returns the same object)."""
        ck = (namespace, pod_id, id(refs))
        hit = ContainerTable._wanted_cache.get(ck)
        if hit is not None and hit[0] is refs:
            return hit[1]
        keys = frozenset(pod_ref_key(namespace, pod, name) if pod else same_pod_key(namespace, pod_id, name)
                         for name, pods in refs.items() for pod in pods)
        if len(ContainerTable._wanted_cache) >= MEMO_ENTRIES:
            ContainerTable._wanted_cache.clear()
        ContainerTable._wanted_cache[ck] = (refs, keys)
        return keys


def _table(items: Any = ()) -> ContainerTable:
    return items if isinstance(items, ContainerTable) else ContainerTable(items)


@dataclass
class Cache:
    pods: dict[str, Pod] = field(default_factory=dict)
    containers: ContainerTable = field(default_factory=_table)  # a dict that keeps its own indexes

    def __post_init__(self) -> None:
        self.containers = _table(self.containers)

    def exclusive_taken(self) -> dict[str, frozenset[int]]:
        return {c.id: c.cpu_set for c in self.containers.values() if c.placement == Kind.EXCLUSIVE and c.live}

    def to_json(self) -> bytes:
        """The cache file's content (orjson encodes the dataclasses natively: ~0.2 ms for 500 containers, short
        enough to hold the owner's lock)."""
        return orjson.dumps({"version": VERSION, "pods": list(self.pods.values()),
                             "containers": list(self.containers.values())})


    @classmethod
    def from_json(cls, text: str | bytes) -> Cache:
        """Parse a cache file; ValueError for anything but the exact shape this version writes."""
        data = orjson.loads(text)  # orjson.JSONDecodeError is a ValueError
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"unsupported cache version {data.get('version') if isinstance(data, dict) else None!r}")
        pods_raw, ctrs_raw = data.get("pods", []), data.get("containers", [])
        if not isinstance(pods_raw, list) or not isinstance(ctrs_raw, list):
            raise ValueError("pods and containers must be lists")
        pods = []
        for i, p in enumerate(pods_raw):
            kw = _check(p, _POD_TYPES, f"pods[{i}]")
            pods.append(Pod(**kw))
        ctrs = []
        for i, c in enumerate(ctrs_raw):
            kw = _check(c, _CTR_TYPES, f"containers[{i}]")
            try:
                kw["placement"] = Kind(kw.get("placement", Kind.SHARED))
                kw["state"] = State(kw.get("state", State.CREATED))
                parse_cpulist(kw.get("cpus", ""))
            except ValueError as e:
                raise ValueError(f"containers[{i}]: {e}") from None
            ctrs.append(Container(**kw))
        return cls({p.id: p for p in pods}, _table({c.id: c for c in ctrs}))

