"""JSON scenarios: a node's topology and its containers, for planning without a running agent.

```json
{
  "name": "two AVX512 and two scalar containers on one pool",
  "topology": {"fixture": "xeon-2s-112c-snc2"},
  "capacities": {"numa_bandwidth_bytes_per_second": 50e9},
  "containers": [
    {"id": "avx-a", "qos": "Burstable", "cpu_request": 1, "cpu_usage": 1.0, "cpuset": "0-223",
     "features": {"avx512_ratio": 0.95}},
    {"id": "web", "qos": "Guaranteed", "cpu_request": 2, "cpu_usage": 1.5, "cpuset": "0-223",
     "annotations": {"cri-resmgr.io/latency-critical": "true"}}
  ],
  "rebalancer": {"max_moves_per_round": 8}
}
```

``topology`` is either ``{"fixture": NAME}`` (a machine of :data:`cri_resmgr.topology.fixtures.MACHINES`)
or explicit CPUs: ``{"cpus": [{"id": 0, "core": 0, "die": 0, "package": 0, "numa_node": 0, "l3": 0,
"base_frequency_hz": 2.6e9}, ...], "l3_size_bytes": 33554432, "numa_distances": {"0": {"1": 21}}}``.
``rebalancer`` overrides the configuration's ``rebalancer`` section for this scenario. Validation is
a Pydantic model (``cri-resmgr rebalance --schema`` prints its JSON schema); every error names the
field, as ``containers.3.cpuset: ...``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config import RebalancerConfig, _deep_merge, _format_errors
from ..sysfs import format_cpulist, parse_cpulist
from ..topology import Cache, Cpu, NumaNode, Topology
from ..topology.fixtures import MACHINES, MachineSpec
from ..topology.sst import classify_cpus as sst_classify_cpus
from .problem import ContainerInput, NodeModel


class ScenarioError(Exception):
    def __init__(self, problems: list[str], source: str = "scenario"):
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))

    def render(self) -> str:
        return "\n".join([f"invalid scenario ({self.source}):"] + [f"  {p}" for p in self.problems])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_M = TypeVar("_M", bound=_Strict)


class ScenarioCpu(_Strict):
    id: int = Field(ge=0)
    core: int = Field(ge=0, description="node-unique core number; threads of one core share it")
    die: int = Field(0, ge=0)
    package: int = Field(0, ge=0)
    numa_node: int = Field(0, ge=0)
    l3: int | None = Field(0, ge=0, description="L3 domain id; null when the CPU has no L3")
    base_frequency_hz: float | None = Field(None, gt=0, allow_inf_nan=False,
                                            description="SST-BF: higher on high-priority cores")
    isolated: bool = False


class ScenarioTopology(_Strict):
    fixture: str | None = Field(None, description="a machine name from topology/fixtures.py MACHINES")
    cpus: list[ScenarioCpu] | None = Field(None, min_length=1)
    l3_size_bytes: Annotated[int, Field(gt=0)] | dict[int, Annotated[int, Field(gt=0)]] = Field(
        32 * 2**20, description="explicit CPUs: one size or per L3 id")
    numa_distances: dict[int, dict[int, Annotated[int, Field(ge=10)]]] | None = Field(
        None, description="explicit CPUs: SLIT distances (10 local, larger remote); default 10 local, 21 remote")

    @field_validator("fixture")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        if v is not None and v not in MACHINES:
            raise ValueError(f"unknown fixture; choose from {', '.join(MACHINES)}")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ScenarioTopology:
        if (self.fixture is None) == (self.cpus is None):
            raise ValueError("give exactly one of 'fixture' or 'cpus'")
        if self.cpus is not None:
            ids = [c.id for c in self.cpus]
            if len(set(ids)) != len(ids):
                raise ValueError(f"CPU ids repeat: {format_cpulist({i for i in ids if ids.count(i) > 1})}")
        return self


Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Capacities(_Strict):
    numa_bandwidth_bytes_per_second: Positive | dict[int, Positive] | None = Field(
        None, description="one value or per NUMA node (nodes not named: rebalancer.numa_bandwidth_bytes_per_second)")
    l3_bandwidth_bytes_per_second: Positive | dict[int, Positive] | None = Field(
        None, description="one value or per L3 id (domains not named: rebalancer.l3_bandwidth_bytes_per_second)")


class Features(_Strict):
    avx512_ratio: float = Field(0.0, ge=0, le=1)
    llc_misses_per_second: float = Field(0.0, ge=0, allow_inf_nan=False)
    memory_bandwidth_bytes_per_second: float | None = Field(None, ge=0, allow_inf_nan=False,
                                                            description="null: LLC misses × 64")
    llc_occupancy_bytes: float = Field(0.0, ge=0, allow_inf_nan=False)


class ScenarioContainer(_Strict):
    id: str = Field(min_length=1)
    name: str = ""
    namespace: str = ""
    pod: str = ""
    qos: Literal["Guaranteed", "Burstable", "BestEffort", ""] = "Burstable"
    cpu_request: float = Field(0.0, ge=0, allow_inf_nan=False, description="CPUs")
    cpu_usage: float = Field(0.0, ge=0, allow_inf_nan=False, description="CPUs (average over the recent window)")
    cpuset: str = Field(description="current cpu list, e.g. 0-55,112-167")
    features: Features = Field(default_factory=Features)
    annotations: dict[str, str] = Field(default_factory=dict)
    exclusive: bool | None = None
    moved_seconds_ago: float | None = Field(None, ge=0, allow_inf_nan=False, description="for the cool-down")

    @field_validator("cpuset")
    @classmethod
    def _cpulist(cls, v: str) -> str:
        if not parse_cpulist(v):
            raise ValueError("empty cpu list")
        return v


class Scenario(_Strict):
    name: str = ""
    description: str = ""
    topology: ScenarioTopology
    capacities: Capacities = Field(default_factory=Capacities)
    containers: list[ScenarioContainer]
    rebalancer: dict[str, Any] = Field(default_factory=dict, description="overrides of the rebalancer config")

    # -- derived -------------------------------------------------------------------------------------
    def build_topology(self) -> Topology:
        t = self.topology
        if t.fixture is not None:
            return topology_from_spec(MACHINES[t.fixture])
        return topology_from_cpus(t.cpus or [], t.l3_size_bytes, t.numa_distances)

    def config(self, base: RebalancerConfig | None = None) -> RebalancerConfig:
        data = (base or RebalancerConfig()).model_dump()
        try:
            return RebalancerConfig.model_validate(_deep_merge(data, self.rebalancer))
        except ValidationError as e:
            raise ScenarioError(_format_errors(e, prefix="rebalancer.")) from None

    def node_model(self, cfg: RebalancerConfig, topo: Topology | None = None) -> NodeModel:
        """The node's model; capacities a per-id map leaves out take the configuration's value."""
        topo = topo or self.build_topology()
        c = self.capacities
        numa_ids = sorted(topo.numa_nodes) or sorted({cpu.numa_node for cpu in topo.cpus.values()})
        l3_ids = sorted({cpu.l3_id for cpu in topo.cpus.values() if cpu.l3_id is not None})
        return NodeModel.from_topology(
            topo,
            numa_bandwidth=_filled(c.numa_bandwidth_bytes_per_second, numa_ids, cfg.numa_bandwidth_bytes_per_second),
            l3_bandwidth=_filled(c.l3_bandwidth_bytes_per_second, l3_ids, cfg.l3_bandwidth_bytes_per_second),
        )

    def inputs(self, now: float = 0.0) -> list[ContainerInput]:
        return [
            ContainerInput(
                id=c.id, cpuset=parse_cpulist(c.cpuset), cpu_usage=c.cpu_usage, cpu_request=c.cpu_request,
                qos=c.qos, name=c.name or c.id, namespace=c.namespace, pod=c.pod,
                avx512_ratio=c.features.avx512_ratio, llc_misses_per_second=c.features.llc_misses_per_second,
                memory_bandwidth_bytes_per_second=c.features.memory_bandwidth_bytes_per_second,
                llc_occupancy_bytes=c.features.llc_occupancy_bytes, annotations=dict(c.annotations),
                exclusive=c.exclusive, last_moved=None if c.moved_seconds_ago is None else now - c.moved_seconds_ago,
            )
            for c in self.containers
        ]


def _filled(given: float | dict[int, float] | None, ids: list[int], default: float | None) -> Any:
    if given is None:
        return default
    if isinstance(given, dict):
        return {i: given.get(i, math.inf if default is None else default) for i in ids}
    return given


def check_topology(t: ScenarioTopology, caps: Capacities | None) -> list[str]:
    """Problems of explicit CPUs a schema cannot see: a core split across packages, dies, NUMA nodes or
    L3 domains (its threads share them), and ids in per-id maps that name nothing."""
    problems: list[str] = []
    cpus = t.cpus or []
    first: dict[int, int] = {}
    for i, c in enumerate(cpus):
        j = first.setdefault(c.core, i)
        if j == i:
            continue
        o = cpus[j]
        for name in ("package", "die", "numa_node", "l3"):
            if getattr(c, name) != getattr(o, name):
                problems.append(f"topology.cpus.{i}.{name}: core {c.core} is split: {name} {getattr(c, name)} here, "
                                f"{getattr(o, name)} on topology.cpus.{j} (the threads of a core share it)")
    numa_ids = {c.numa_node for c in cpus}
    l3_ids = {c.l3 for c in cpus if c.l3 is not None}
    if t.fixture is not None:
        topo = topology_from_spec(MACHINES[t.fixture])
        numa_ids = set(topo.numa_nodes)
        l3_ids = {c.l3_id for c in topo.cpus.values() if c.l3_id is not None}
    if isinstance(t.l3_size_bytes, dict):
        problems += _unknown_ids("topology.l3_size_bytes", t.l3_size_bytes, l3_ids, "L3 id")
    for a, row in (t.numa_distances or {}).items():
        problems += _unknown_ids("topology.numa_distances", {a: 0}, numa_ids, "NUMA node")
        problems += _unknown_ids(f"topology.numa_distances.{a}", row, numa_ids, "NUMA node")
        if a in row and row[a] != 10:
            problems.append(f"topology.numa_distances.{a}.{a}: a node's distance to itself is 10 (got {row[a]})")
    if caps is None:
        return problems
    if isinstance(caps.numa_bandwidth_bytes_per_second, dict):
        problems += _unknown_ids("capacities.numa_bandwidth_bytes_per_second", caps.numa_bandwidth_bytes_per_second,
                                 numa_ids, "NUMA node")
    if isinstance(caps.l3_bandwidth_bytes_per_second, dict):
        problems += _unknown_ids("capacities.l3_bandwidth_bytes_per_second", caps.l3_bandwidth_bytes_per_second,
                                 l3_ids, "L3 id")
    return problems


def _unknown_ids(path: str, given: Mapping[int, Any], known: set[int], what: str) -> list[str]:
    return [f"{path}.{k}: no {what} {k} in the topology (it has {format_cpulist(known) or 'none'})"
            for k in sorted(given) if k not in known]


def check_semantics(containers: list[tuple[int, ScenarioContainer]], online: frozenset[int]) -> list[str]:
    """Problems a schema cannot see: cpusets outside the topology's CPUs, repeated ids."""
    problems = []
    seen: dict[str, int] = {}
    for i, c in containers:
        if c.id in seen:
            problems.append(f"containers.{i}.id: {c.id!r} repeats containers.{seen[c.id]}.id")
        seen.setdefault(c.id, i)
        stray = parse_cpulist(c.cpuset) - online
        if stray:
            problems.append(f"containers.{i}.cpuset: CPUs {format_cpulist(stray)} are not in the topology "
                            f"({format_cpulist(online)})")
    return problems


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    """The scenario, or a :class:`ScenarioError` naming every problem (schema and semantics) by its
    field path. When the schema fails, the semantic checks still run on the parts that validate on
    their own, so one run reports everything."""
    if not isinstance(data, Mapping):
        raise ScenarioError([f"<root>: expected an object, got {type(data).__name__}"], source)
    sc: Scenario | None = None
    problems: list[str] = []
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as e:
        problems += scenario_errors(e)
    if sc is not None:
        topo: ScenarioTopology | None = sc.topology
        caps: Capacities | None = sc.capacities
        containers = list(enumerate(sc.containers))
    else:
        topo = _part(ScenarioTopology, data.get("topology"))
        caps = _part(Capacities, data.get("capacities", {}))
        raw = data.get("containers")
        parts = [(i, _part(ScenarioContainer, c)) for i, c in enumerate(raw)] if isinstance(raw, list) else []
        containers = [(i, c) for i, c in parts if c is not None]
    if topo is not None:
        problems += check_topology(topo, caps)
        online = (frozenset(c.id for c in topo.cpus) if topo.cpus is not None
                  else frozenset(topology_from_spec(MACHINES[topo.fixture or ""]).cpus))
        problems += check_semantics(containers, online)
    overrides = data.get("rebalancer", {})
    if isinstance(overrides, Mapping):
        try:  # the rebalancer overrides must validate too
            cfg = _config_of(dict(overrides))
        except ScenarioError as e:
            problems += e.problems
        else:
            if sc is not None and not problems:
                try:
                    sc.node_model(cfg)
                except ValueError as e:  # what the model itself refuses
                    problems.append(f"topology: {e}")
    if problems:
        raise ScenarioError(problems, source)
    assert sc is not None
    return sc


def _config_of(overrides: dict[str, Any]) -> RebalancerConfig:
    try:
        return RebalancerConfig.model_validate(_deep_merge(RebalancerConfig().model_dump(), overrides))
    except ValidationError as e:
        raise ScenarioError(_format_errors(e, prefix="rebalancer.")) from None


def _part(model: type[_M], raw: Any) -> _M | None:
    try:
        return model.model_validate(raw)
    except ValidationError:
        return None


# Union members Pydantic names in an error's location ("constrained-float", "dict[int,...]"): not fields.
_UNION_TAG = re.compile(r"^(constrained-\w+|float|int|str|bool|none|dict\[.*\]|list\[.*\])$")
_WRONG_MEMBER = {"float_type", "float_parsing", "int_type", "int_parsing", "dict_type", "list_type"}


def scenario_errors(err: ValidationError) -> list[str]:
    """Pydantic's errors as ``field.path: message``, union members folded into their field: of the
    errors one field's union gives, those that only say the value is not of a member's type are
    dropped when another says more."""
    by_field: dict[str, list[tuple[str, str]]] = {}
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p))) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        if e["type"] != "extra_forbidden" and "input" in e and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {e['input']!r})"
        by_field.setdefault(loc, []).append((e["type"], msg))
    out = []
    for loc, errs in by_field.items():
        deeper = any(other.startswith(loc + ".") for other in by_field)  # a member that matched says more
        telling = [m for t, m in errs if t not in _WRONG_MEMBER] or ([] if deeper else [m for _, m in errs])
        out += [f"{loc}: {m}" for m in dict.fromkeys(telling)]
    return out


def load_scenario(path: Path) -> Scenario:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ScenarioError([f"cannot read: {e.strerror}"], str(path)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScenarioError([f"line {e.lineno}, column {e.colno}: not valid JSON: {e.msg}"], str(path)) from None
    return parse_scenario(data, str(path))


# -- topologies without sysfs --------------------------------------------------------------------------
def _with_sst_bf(cpus: dict[int, Cpu]) -> dict[int, Cpu]:
    """Mark SST-BF classes as discovery does (topology/sst.py)."""
    bf = sst_classify_cpus(cpus.values())
    if not bf.enabled:
        return cpus
    return {i: replace(c, sst_bf_priority=bf.priority.get(i, "")) for i, c in cpus.items()}


def topology_from_spec(spec: MachineSpec) -> Topology:
    """The topology :func:`cri_resmgr.topology.discover` finds in ``build_sysfs(spec)``, built directly
    (same layout function, no files; the tests compare the two)."""
    layout = [r for r in spec.layout() if r["cpu"] not in spec.offline]
    online = frozenset(r["cpu"] for r in layout)
    cpus = {}
    for r in layout:
        sib = [s for s in r["siblings"] if s in online]
        khz = spec.base_frequency_overrides_khz.get(r["cpu"], spec.base_frequency_khz)
        cpus[r["cpu"]] = Cpu(id=r["cpu"], package=r["package"], die=r["die"], core_id=r["core_id"], core=min(sib),
                             numa_node=r["numa_node"], l2_id=r["l2_id"], l3_id=r["l3_id"],
                             isolated=r["cpu"] in spec.isolated, base_frequency_hz=khz * 1000 if khz else None)
    cpus = _with_sst_bf(cpus)
    l3: dict[int, set[int]] = {}
    for c in cpus.values():
        if c.l3_id is not None:
            l3.setdefault(c.l3_id, set()).add(c.id)
    caches = [Cache(3, "Unified", spec.l3_kib_per_domain * 1024, i, frozenset(s)) for i, s in sorted(l3.items())]
    nodes = list(range(spec.numa_nodes))
    numa = {n: NumaNode(n, frozenset(c.id for c in cpus.values() if c.numa_node == n),
                        {m: spec.distance(n, m) for m in nodes}) for n in nodes}
    present = frozenset(r["cpu"] for r in spec.layout())
    return Topology(cpus=cpus, numa_nodes=numa, caches=caches, present=present, online=online,
                    offline=frozenset(spec.offline), isolated=frozenset(spec.isolated) & online)


def topology_from_cpus(cpus: list[ScenarioCpu], l3_size: int | dict[int, int],
                       distances: dict[int, dict[int, int]] | None) -> Topology:
    out: dict[int, Cpu] = {}
    for s in cpus:
        out[s.id] = Cpu(id=s.id, package=s.package, die=s.die, core_id=s.core, core=s.core, numa_node=s.numa_node,
                        l2_id=s.core, l3_id=s.l3, isolated=s.isolated,
                        base_frequency_hz=int(s.base_frequency_hz) if s.base_frequency_hz else None)
    # The model wants a node-unique core number equal to the lowest CPU of the core (as discover gives).
    lowest: dict[tuple[int, int], int] = {}
    for c in out.values():
        k = (c.package, c.core_id)
        lowest[k] = min(lowest.get(k, c.id), c.id)
    out = _with_sst_bf({i: replace(c, core=lowest[(c.package, c.core_id)]) for i, c in out.items()})
    l3: dict[int, set[int]] = {}
    for c in out.values():
        if c.l3_id is not None:
            l3.setdefault(c.l3_id, set()).add(c.id)

    def size(i: int) -> int:
        return l3_size.get(i, 32 * 2**20) if isinstance(l3_size, dict) else l3_size

    caches = [Cache(3, "Unified", size(i), i, frozenset(s)) for i, s in sorted(l3.items())]
    node_ids = sorted({c.numa_node for c in out.values()})
    numa = {}
    for n in node_ids:
        given = (distances or {}).get(n, {})
        numa[n] = NumaNode(n, frozenset(c.id for c in out.values() if c.numa_node == n),
                           {m: given.get(m, 10 if m == n else 21) for m in node_ids})
    ids = frozenset(out)
    return Topology(cpus=out, numa_nodes=numa, caches=caches, present=ids, online=ids,
                    isolated=frozenset(c.id for c in out.values() if c.isolated))


def scenario_cpus_from_spec(spec: MachineSpec) -> list[dict]:
    """Explicit-CPU topology entries for a machine spec (to write self-contained scenario files)."""
    topo = topology_from_spec(spec)
    return [dict(id=c.id, core=c.core, die=c.die, package=c.package, numa_node=c.numa_node, l3=c.l3_id,
                 base_frequency_hz=c.base_frequency_hz, isolated=c.isolated)
            for c in sorted(topo.cpus.values(), key=lambda c: c.id)]
