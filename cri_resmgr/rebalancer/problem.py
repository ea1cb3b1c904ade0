"""Typed inputs of the cost model: containers, the node in tree order, candidates, a problem, a placement.

The model sees a node as CPUs in *tree order*: the topology tree (package → die → NUMA node → L3 domain
→ halves of the core list → core → hardware threads) flattened depth first, so every tree node is a
contiguous interval of positions. A container's placement is a row of *shares* over the positions:
``1/|cpuset|`` on each CPU of its cpuset (the scheduler spreads a container's runnable threads over its
cpuset; the model assumes evenly). Every interference term is a function of a few per-CPU *fields*
``F = Sᵀ X`` — the sum over containers of share × attribute (CPU demand, AVX512 load, latency-sensitive
load, latency-critical demand, memory bandwidth, cache occupancy) — so a move updates ``F`` in O(CPUs)
and the change of every term for every (container, candidate) pair is computed with interval sums over
the tree order (numpy, no Python loop over candidates). The field indices (``DEMAND`` … ``OCC``) live
here, beside the :class:`Problem` and :class:`State` that use them; :mod:`.terms` and :mod:`.exact`
read them from here, and :mod:`.model` combines the terms.

A move takes a container from its cpuset to a *candidate*: a tree node intersected with the shared pool
(online CPUs less reserved ones and those of exclusive containers that stay put). The objective of a
plan is ``J = amortization_seconds × I(after) + Σ migration cost``: interference is a rate (cost units
per second), migration a one-off charge, so a move pays when its gain over the amortization period
exceeds its cost. The interference terms live in :mod:`.terms`; each documents its reasoning and unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import RebalancerConfig
from ..placement import annotations as ann
from ..sysfs import format_cpulist, parse_cpulist
from ..topology import Topology
from ..topology.sst import classify_cpus as sst_classify_cpus

# Annotations (pod or container) the model understands, read by the one rule of placement/annotations.py.
# The relay passes CRI annotations through its container cache; scenarios and config overrides can set
# the same meaning directly.
ANNOTATION_LATENCY_CRITICAL = ann.LATENCY_CRITICAL
ANNOTATION_AVX512 = ann.AVX512
ANNOTATION_REBALANCE = ann.PREFIX + "rebalance"  # "false": never move this container

# Columns of the per-container attribute matrix X (and of the per-CPU field matrix F = Sᵀ X).
DEMAND, AVX, SENS, LC, BW, OCC = range(6)
NATTR = 6
ATTR_NAMES = ("cpu_demand", "avx512_load", "sensitive_load", "latency_critical_demand",
              "memory_bandwidth_bytes_per_second", "llc_occupancy_bytes")

# One LLC miss fetches one 64-byte line from memory: the bandwidth estimate when MBM is not measured
# (Intel 64 and IA-32 Architectures Optimization Reference Manual, "cache line size").
CACHE_LINE_BYTES = 64

@dataclass(frozen=True)
class ContainerInput:
    """What the model knows of one container. Rates are averages over the recent window."""

    id: str
    cpuset: frozenset[int]
    cpu_usage: float = 0.0  # CPUs (CPU-seconds per second)
    cpu_request: float = 0.0  # CPUs; 0 when unknown
    qos: str = ""  # Guaranteed, Burstable, BestEffort, or "" (not a Kubernetes container)
    name: str = ""
    namespace: str = ""
    pod: str = ""
    avx512_ratio: float = 0.0  # share of context switches with 512-bit state in use (avx512 collector)
    llc_misses_per_second: float | None = None  # None: not measured in the window (perf budget): counts as 0
    memory_bandwidth_bytes_per_second: float | None = None  # None: estimated from LLC misses
    llc_occupancy_bytes: float | None = None  # None: not measured in the window (RDT rotation): counts as 0
    annotations: Mapping[str, str] = field(default_factory=dict)
    exclusive: bool | None = None  # None: derived (Guaranteed with a pinned cpuset)
    last_moved: float | None = None  # wall-clock time of the last move applied to it
    pinned_reason: str | None = None  # set when something outside the model forbids moving it

    @property
    def latency_critical(self) -> bool:
        return ann.truthy(self.annotations.get(ANNOTATION_LATENCY_CRITICAL))

    @property
    def avx512_hint(self) -> bool:
        return ann.truthy(self.annotations.get(ANNOTATION_AVX512))

    @property
    def opted_out(self) -> bool:
        v = self.annotations.get(ANNOTATION_REBALANCE)
        return v is not None and v.strip().lower() in ("0", "false", "no", "off")

    def bandwidth(self) -> float:
        if self.memory_bandwidth_bytes_per_second is not None:
            return self.memory_bandwidth_bytes_per_second
        return (self.llc_misses_per_second or 0.0) * CACHE_LINE_BYTES

    def is_exclusive(self, online: frozenset[int]) -> bool:
        if self.exclusive is not None:
            return self.exclusive
        if self.qos != "Guaranteed" or not self.cpuset or self.cpuset >= online:
            return False
        req = self.cpu_request
        # Whole-CPU Guaranteed containers get CPUs of their own (kubelet's static CPU manager policy,
        # the relay's placement); with the request unknown, a pinned Guaranteed cpuset says the same.
        return req == 0 or (float(req).is_integer() and len(self.cpuset) == int(req))


# -- the node ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeNode:
    lo: int  # first position (tree order)
    hi: int  # one past the last
    depth: int
    parent: int  # index into NodeModel.tree, -1 for the root
    label: str


def _groups(cpus, key) -> list[tuple[object, list]]:
    out: dict[object, list] = {}
    for c in cpus:
        out.setdefault(key(c), []).append(c)
    return sorted(out.items(), key=lambda kv: (str(type(kv[0])), kv[0]))


_LEVELS = (
    ("package", lambda c: c.package),
    ("die", lambda c: (c.package, c.die)),
    ("numa", lambda c: c.numa_node),
    ("l3", lambda c: -1 if c.l3_id is None else c.l3_id),
)


def _level_value(name: str, v) -> str:
    return str(v[1]) if name == "die" else str(v)


@dataclass
class NodeModel:
    """Per-position arrays of a topology, in tree order, and the tree itself."""

    cpu_ids: np.ndarray  # position -> CPU id
    pos: dict[int, int]  # CPU id -> position
    core_of: np.ndarray  # position -> core index
    core_starts: np.ndarray  # first position of each core (threads of a core are consecutive)
    threads_per_core: np.ndarray  # per core index
    pkg_of: np.ndarray
    pkg_cpus: np.ndarray  # CPUs per package index
    numa_of: np.ndarray
    l3_of: np.ndarray
    package_ids: list[int]
    numa_ids: list[int]
    l3_ids: list[int]  # -1: CPUs without a known L3
    l3_size_bytes: np.ndarray  # per l3 index, 0 when unknown
    numa_distance: np.ndarray  # relative (SLIT / 10): 1.0 local
    numa_bandwidth: np.ndarray  # bytes/s per numa index
    l3_bandwidth: np.ndarray | None  # bytes/s per l3 index, None: no limit
    high_priority: np.ndarray  # bool per position: SST-BF high-priority core
    isolated: np.ndarray  # bool per position
    tree: list[TreeNode]
    onehot_numa: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))  # positions × numa
    onehot_l3: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))
    onehot_pkg: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))
    onehot_core: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))

    @property
    def ncpu(self) -> int:
        return len(self.cpu_ids)

    @property
    def has_sst_bf(self) -> bool:
        return bool(self.high_priority.any())

    def positions(self, cpus: Iterable[int]) -> np.ndarray:
        return np.array(sorted(self.pos[c] for c in cpus if c in self.pos), dtype=np.int64)

    def cpus_of(self, positions: Iterable[int]) -> frozenset[int]:
        return frozenset(int(self.cpu_ids[p]) for p in positions)

    def mems_of(self, positions: Iterable[int]) -> frozenset[int]:
        return frozenset(self.numa_ids[self.numa_of[p]] for p in positions)

    @classmethod
    def from_topology(cls, topo: Topology, numa_bandwidth: float | Mapping[int, float] = 100e9,
                      l3_bandwidth: float | Mapping[int, float] | None = None) -> NodeModel:
        if not topo.cpus:
            raise ValueError("topology has no online CPUs")
        order: list = []
        tree: list[TreeNode | None] = []

        def rec(cpus: list, level: int, depth: int, parent: int, label: str) -> None:
            idx = len(tree)
            tree.append(None)
            lo = len(order)
            for li in range(level, len(_LEVELS)):
                name, key = _LEVELS[li]
                groups = _groups(cpus, key)
                if len(groups) >= 2:
                    for v, g in groups:
                        rec(g, li + 1, depth + 1, idx, f"{label}/{name} {_level_value(name, v)}".lstrip("/"))
                    break
            else:
                cores = _groups(cpus, lambda c: c.core)
                if len(cores) >= 2:
                    half = (len(cores) + 1) // 2
                    for part in (cores[:half], cores[half:]):
                        ids = [k for k, _ in part]
                        sub = f"cores {format_cpulist(ids)}" if len(ids) > 1 else f"core {ids[0]}"
                        rec([c for _, g in part for c in g], len(_LEVELS), depth + 1, idx,
                            f"{label}/{sub}".lstrip("/"))
                else:
                    order.extend(sorted(cpus, key=lambda c: c.id))
            tree[idx] = TreeNode(lo, len(order), depth, parent, label or "all")

        rec(sorted(topo.cpus.values(), key=lambda c: c.id), 0, 0, -1, "")
        ids = np.array([c.id for c in order], dtype=np.int64)
        pos = {int(c): i for i, c in enumerate(ids)}

        core_keys = [c.core for c in order]
        core_index: dict[int, int] = {}
        for k in core_keys:
            core_index.setdefault(k, len(core_index))
        core_of = np.array([core_index[k] for k in core_keys], dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, core_of[1:] != core_of[:-1]])
        if len(starts) != len(core_index):
            raise ValueError("internal: threads of a core are not consecutive in tree order")
        tpc = np.diff(np.r_[starts, len(order)]).astype(np.float64)

        def index(values: list) -> tuple[np.ndarray, list]:
            uniq = sorted(set(values))
            m = {v: i for i, v in enumerate(uniq)}
            return np.array([m[v] for v in values], dtype=np.int64), uniq

        pkg_of, pkg_ids = index([c.package for c in order])
        numa_of, numa_ids = index([c.numa_node for c in order])
        l3_of, l3_ids = index([-1 if c.l3_id is None else c.l3_id for c in order])
        sizes = {c.id: c.size_bytes for c in topo.caches_at(3)}
        l3_size = np.array([float(sizes.get(i, 0)) if i >= 0 else 0.0 for i in l3_ids])

        dist = np.full((len(numa_ids), len(numa_ids)), 2.0)
        for a, na in enumerate(numa_ids):
            node = topo.numa_nodes.get(na)
            for b, nb in enumerate(numa_ids):
                d = node.distances.get(nb) if node else None
                dist[a, b] = (d / 10.0) if d else (1.0 if a == b else 2.0)

        def per(values: float | Mapping[int, float], keys: list, default: float) -> np.ndarray:
            if isinstance(values, Mapping):
                return np.array([float(values.get(k, default)) for k in keys])
            return np.full(len(keys), float(values))

        # SST-BF: high-priority cores have a base frequency above the package's lowest
        # (Documentation/admin-guide/pm/intel-speed-select.rst); one classification for the whole
        # project, topology/sst.py.
        high = sst_classify_cpus(topo.cpus.values()).high_priority
        hp = np.array([c.id in high for c in order], dtype=bool)

        def onehot(of: np.ndarray, n: int) -> np.ndarray:
            m = np.zeros((len(of), n))
            m[np.arange(len(of)), of] = 1.0
            return m

        nm = cls(
            cpu_ids=ids, pos=pos, core_of=core_of, core_starts=starts, threads_per_core=tpc,
            pkg_of=pkg_of, pkg_cpus=np.bincount(pkg_of, minlength=len(pkg_ids)).astype(np.float64),
            numa_of=numa_of, l3_of=l3_of, package_ids=pkg_ids, numa_ids=numa_ids, l3_ids=l3_ids,
            l3_size_bytes=l3_size, numa_distance=dist,
            numa_bandwidth=per(numa_bandwidth, numa_ids, 100e9),
            l3_bandwidth=None if l3_bandwidth is None else per(l3_bandwidth, l3_ids, math.inf),
            high_priority=hp, isolated=np.array([c.isolated for c in order], dtype=bool),
            tree=[t for t in tree if t is not None],
        )
        nm.onehot_numa = onehot(numa_of, len(numa_ids))
        nm.onehot_l3 = onehot(l3_of, len(l3_ids))
        nm.onehot_pkg = onehot(pkg_of, len(pkg_ids))
        nm.onehot_core = onehot(core_of, len(starts))
        return nm


# -- candidates --------------------------------------------------------------------------------------
FEW_CPUS = 8


class Candidates:
    """Destinations a container can move to: tree nodes ∩ pool, deduplicated, each a position interval."""

    def __init__(self, node: NodeModel, pool: np.ndarray):
        self.node = node
        self.pool = pool.astype(np.float64)
        pool_pos = np.flatnonzero(pool)
        # Per tree node, its pool positions: pool_pos[a:b].
        a = np.searchsorted(pool_pos, [t.lo for t in node.tree]).tolist()
        b = np.searchsorted(pool_pos, [t.hi for t in node.tree]).tolist()
        seen: dict[tuple[int, int], int] = {}
        lo: list[int] = []
        hi: list[int] = []
        size: list[int] = []
        labels: list[str] = []
        depth: list[int] = []
        for t, ta, tb in zip(node.tree, a, b, strict=True):
            z = tb - ta
            if z == 0:
                continue
            key = (int(pool_pos[ta]), int(pool_pos[tb - 1]))
            if key in seen:
                continue
            seen[key] = len(lo)
            lo.append(key[0])
            hi.append(key[1] + 1)
            size.append(z)
            labels.append(t.label)
            depth.append(t.depth)
        self.lo = np.array(lo, dtype=np.int64)
        self.hi = np.array(hi, dtype=np.int64)
        self.size = np.array(size, dtype=np.int64)
        self.labels = labels
        self.depth = np.array(depth, dtype=np.int64)
        self.n = len(lo)
        self.size_classes = [(int(z), np.flatnonzero(self.size == z)) for z in np.unique(self.size)]
        at = np.arange(node.ncpu)
        masks = (at[None, :] >= self.lo[:, None]) & (at[None, :] < self.hi[:, None]) & (pool[None, :] > 0)
        self._key = {m.tobytes(): i for i, m in enumerate(masks)}
        # Candidates × positions share matrix; domain shares follow with one product each.
        cs = np.zeros((self.n, node.ncpu + 1))
        np.add.at(cs, (np.arange(self.n), self.lo), 1.0)
        np.add.at(cs, (np.arange(self.n), self.hi), -1.0)
        self.rows = np.cumsum(cs, axis=1)[:, :-1] * self.pool[None, :] / self.size[:, None]
        self.share_numa = self.rows @ node.onehot_numa
        self.share_l3 = self.rows @ node.onehot_l3
        self.share_pkg = self.rows @ node.onehot_pkg
        # Few candidates span several domains (the root, packages); all others sit inside one, so a
        # domain term evaluates its convex function only on the distinct share vectors (u) and
        # gathers per candidate (inv).
        self.unique_numa = self._unique(self.share_numa)
        self.unique_l3 = self._unique(self.share_l3)
        # Membership lists: every (candidate, pool position) pair, grouped by candidate.
        member = self.rows > 0
        self.member_cand, self.member_pos = np.nonzero(member)
        self.member_start = np.r_[0, np.cumsum(member.sum(axis=1))]
        by_pos = np.argsort(self.member_pos, kind="stable")
        self.pos_cand = self.member_cand[by_pos]  # candidates holding each position, grouped by position
        self.pos_start = np.r_[0, np.cumsum(np.bincount(self.member_pos, minlength=node.ncpu))]
        # Candidates of few CPUs (cores, threads: most of them), over which a per-CPU function is summed
        # directly rather than through sorted loads (terms.Oversubscription.delta); the others held by
        # each position, grouped by position.
        self.few = self.size <= FEW_CPUS
        m = self.few[self.member_cand]
        self.few_cand, self.few_pos = self.member_cand[m], self.member_pos[m]  # their members, by candidate
        self.few_start = np.flatnonzero(np.r_[True, self.few_cand[1:] != self.few_cand[:-1]]) if m.any() else \
            np.zeros(0, dtype=np.int64)
        many = ~self.few[self.pos_cand]
        self.pos_many = self.pos_cand[many]
        self.pos_many_start = np.r_[0, np.cumsum(np.bincount(self.member_pos[by_pos][many], minlength=node.ncpu))]

    @staticmethod
    def _unique(share: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u, inv = np.unique(np.round(share, 12), axis=0, return_inverse=True)
        return u, inv.reshape(-1)

    def holding(self, pos: np.ndarray, many: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Every (index into ``pos``, candidate holding that position) pair: (indices, candidates); with
        ``many``, only candidates of more than ``FEW_CPUS`` CPUs."""
        cands, start = (self.pos_many, self.pos_many_start) if many else (self.pos_cand, self.pos_start)
        counts = start[pos + 1] - start[pos]
        idx = np.repeat(np.arange(len(pos)), counts)
        offsets = np.zeros(len(pos), dtype=np.int64)
        np.cumsum(counts[:-1], out=offsets[1:])
        first = np.repeat(start[pos] - offsets, counts)
        return idx, cands[first + np.arange(len(idx))]

    def index_of(self, positions: np.ndarray) -> int:
        m = np.zeros(self.node.ncpu, dtype=bool)
        m[positions] = True
        return self._key.get(m.tobytes(), -1)

    def row(self, c: int) -> np.ndarray:
        return self.rows[c].copy()

    def positions(self, c: int) -> np.ndarray:
        return self.lo[c] + np.flatnonzero(self.pool[self.lo[c]:self.hi[c]])

    def mean(self, field_: np.ndarray) -> np.ndarray:
        """Pool-weighted mean of a per-position field over every candidate (one cumsum)."""
        cs = np.zeros(len(field_) + 1)
        np.cumsum(field_ * self.pool, out=cs[1:])
        return (cs[self.hi] - cs[self.lo]) / self.size



# -- one planning problem ----------------------------------------------------------------------------
QOS_SENSITIVITY = {"Guaranteed": 1.0, "Burstable": 1.0, "": 1.0}


@dataclass
class Problem:
    node: NodeModel
    cfg: RebalancerConfig
    containers: list[ContainerInput]  # sorted by id: the planner's order, hence deterministic
    X: np.ndarray  # containers × NATTR
    usage: np.ndarray
    S0: np.ndarray  # containers × positions: shares of the current placement
    pool: np.ndarray  # bool per position
    cand: Candidates | None  # None when the shared pool is empty: nothing can move
    movable: np.ndarray  # bool per container
    fixed_reason: list[str | None]
    need: np.ndarray  # smallest candidate size (CPUs) per container
    current: np.ndarray  # candidate index equal to the current cpuset, or -1
    notes: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.containers)

    @property
    def cands(self) -> Candidates:
        """The candidates, for code that runs only when something can move."""
        if self.cand is None:
            raise ValueError("no candidates: the shared pool is empty")
        return self.cand

    @classmethod
    def build(cls, node: NodeModel, containers: Sequence[ContainerInput], cfg: RebalancerConfig,
              now: float | None = None) -> Problem:
        cs = sorted(containers, key=lambda c: c.id)
        ids = [c.id for c in cs]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"duplicate container ids: {', '.join(dup)}")
        online = frozenset(int(c) for c in node.cpu_ids)
        reserved = parse_cpulist(cfg.reserved_cpus)
        n, P = len(cs), node.ncpu
        notes: list[str] = []

        movable = np.ones(n, dtype=bool)
        reason: list[str | None] = [None] * n
        pool = ~node.isolated.copy()
        for cpu in reserved:
            if cpu in node.pos:
                pool[node.pos[cpu]] = False
        for i, c in enumerate(cs):
            if c.is_exclusive(online) and not cfg.move_exclusive:
                movable[i], reason[i] = False, "exclusive"
                for cpu in c.cpuset:
                    if cpu in node.pos:
                        pool[node.pos[cpu]] = False
            elif c.pinned_reason:
                movable[i], reason[i] = False, c.pinned_reason
            elif c.opted_out:
                movable[i], reason[i] = False, f"annotation {ANNOTATION_REBALANCE}=false"
            elif cfg.namespaces and c.namespace not in cfg.namespaces:
                movable[i], reason[i] = False, "namespace not selected"
            elif now is not None and c.last_moved is not None and now - c.last_moved < cfg.cooldown_seconds:
                movable[i], reason[i] = False, "cool-down"
        if not pool.any():
            notes.append("no CPUs left in the shared pool: nothing can move")
            pool = np.zeros(P, dtype=bool)
            movable[:] = False
        cand = Candidates(node, pool) if pool.any() else None

        X = np.zeros((n, NATTR))
        usage = np.zeros(n)
        S0 = np.zeros((n, P))
        need = np.ones(n, dtype=np.int64)
        current = np.full(n, -1, dtype=np.int64)
        rows: dict[frozenset[int], tuple[np.ndarray, int]] = {}
        pool_pos = np.flatnonzero(pool)
        for i, c in enumerate(cs):
            hit = rows.get(c.cpuset)
            if hit is None:
                p = node.positions(c.cpuset)
                if len(p) == 0:
                    notes.append(f"{c.id}: cpuset {format_cpulist(c.cpuset) or '(empty)'} has no online CPU; "
                                 "taken as the shared pool")
                    p = pool_pos if len(pool_pos) else np.arange(P)
                r = np.zeros(P)
                r[p] = 1.0 / len(p)
                hit = rows[c.cpuset] = (r, cand.index_of(p) if cand is not None else -1)
            S0[i], current[i] = hit
            u = max(0.0, c.cpu_usage)
            usage[i] = u
            avx = c.avx512_hint or c.avx512_ratio >= cfg.avx512_threshold
            sens = cfg.besteffort_sensitivity if c.qos == "BestEffort" else QOS_SENSITIVITY.get(c.qos, 1.0)
            lc = c.latency_critical
            if lc:
                sens *= cfg.latency_critical_factor
            demand = max(u, c.cpu_request)
            X[i] = (demand, u if avx else 0.0, 0.0 if avx else u * sens,
                    demand if lc else 0.0, max(0.0, c.bandwidth()),
                    max(0.0, c.llc_occupancy_bytes or 0.0))
            need[i] = max(1, math.ceil(c.cpu_request - 1e-9))
        return cls(node, cfg, cs, X, usage, S0, pool, cand, movable, reason, need, current, notes)

    def valid(self, rows: np.ndarray) -> np.ndarray:
        """rows × candidates: big enough and not the container's current cpuset."""
        v = self.cands.size[None, :] >= self.need[rows, None]
        cur = self.current[rows]
        has = cur >= 0
        v[np.flatnonzero(has), cur[has]] = False
        return v


class State:
    """A placement (share rows) and its per-CPU fields ``F = Sᵀ X``, updated incrementally.

    Terms keep what they derive from the fields alone (sorted loads, per-domain loads) in :meth:`memo`:
    the same for every row a search scores until the placement changes."""

    def __init__(self, prob: Problem, S: np.ndarray | None = None):
        self.prob = prob
        self.S = prob.S0.copy() if S is None else S
        self.F = self.S.T @ prob.X  # positions × NATTR
        self._memo: dict[str, Any] = {}

    def set_row(self, i: int, row: np.ndarray) -> None:
        self.F += np.outer(row - self.S[i], self.prob.X[i])
        self.S[i] = row
        self._memo = {}

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per placement."""
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = make()
        return v

    def snapshot(self, i: int) -> tuple[np.ndarray, int, np.ndarray, dict[str, Any]]:
        """What :meth:`restore` needs to undo changes of row ``i``."""
        return self.F.copy(), i, self.S[i].copy(), self._memo

    def restore(self, snap: tuple[np.ndarray, int, np.ndarray, dict[str, Any]]) -> None:
        """Back to the placement of :meth:`snapshot` exactly (fields copied, not recomputed)."""
        F, i, row, memo = snap
        self.F[:] = F
        self.S[i] = row
        self._memo = memo

    def copy(self) -> State:
        st = State.__new__(State)
        st.prob, st.S, st.F, st._memo = self.prob, self.S.copy(), self.F.copy(), self._memo
        return st
