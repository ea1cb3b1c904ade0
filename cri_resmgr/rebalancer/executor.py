"""Executor: one rebalancing round — read inputs, plan, and (in ``enforce`` mode) apply the moves.

Modes (``rebalancer.mode``): ``off`` (nothing runs), ``advise`` (default: plans are computed and shown
at ``/api/v1/rebalancer/plan``, nothing is applied) and ``enforce`` (moves are applied through a
:class:`MoveApplier`). The relay implements ``MoveApplier`` with UpdateContainerResources and
keeps its cache and shared pool consistent; :class:`CgroupMoveApplier` writes the container cgroup's
``cpuset.cpus``/``cpuset.mems`` directly — for extra cgroups, tests, and nodes without the relay (a
runtime that later updates the container will overwrite it).

Each round writes ``cri_resmgr_rebalancer_moves_total{result}``, ``cri_resmgr_rebalancer_cost{when}``
and ``cri_resmgr_rebalancer_plan_duration_seconds`` into the store table ``rebalancer``, so they are
exported and have history like every other series.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel

from .. import metrics as M
from ..collectors.cgroup import detect_layout
from ..config import RebalancerConfig
from ..store import Sample, Store
from ..sysfs import format_cpulist, parse_cpulist, read_text
from ..topology import Topology
from .explain import Explanation, move_why
from .planner import Plan, Planner
from .problem import NodeModel, Problem
from .signals import CpusetSource, Inputs, MetadataSource, read_inputs

log = logging.getLogger(__name__)

TABLE = "rebalancer"
RoundGate = Callable[[Inputs, RebalancerConfig, float, str], "str | None"]
"""(inputs, config, now, mode) -> a reason to skip the round's planning, or None to plan (service.py)."""
RESULTS = ("applied", "failed", "advised")


@dataclasses.dataclass(frozen=True)
class MoveResult:
    ok: bool
    error: str | None = None
    cpus: frozenset[int] | None = None  # what the container has now, when the applier can tell


class MoveApplier(Protocol):
    """Applies a new cpuset (and memory nodes) to a running container. The relay's move API implements
    this; it must refuse exclusive containers unless configured and record each move."""

    def apply(self, container_id: str, cpus: frozenset[int], mems: frozenset[int] | None,
              reason: str, explanation: Explanation | None = None) -> MoveResult: ...


class CgroupMoveApplier:
    """Writes ``cpuset.cpus`` and ``cpuset.mems`` of the container's cgroup.

    Files: cgroup v1 ``cpuset/<path>/cpuset.{cpus,mems}`` (Documentation/admin-guide/cgroup-v1/cpusets.rst
    §2), v2 ``<path>/cpuset.{cpus,mems}`` (cgroup-v2.rst, "Cpuset Interface Files"). mems are written
    first when they grow and last when they shrink, so the cgroup never has CPUs without memory
    nodes to allocate from. ``cpuset.cpus`` is read back; the effective CPUs (the kernel's
    intersection with the parent's) show in the cgroup collector's next cycle.
    """

    def __init__(self, cgroup_root: Path, resolve: Callable[[str], str | None]):
        self.cgroup_root = Path(cgroup_root)
        self.resolve = resolve  # container id -> cgroup path relative to the hierarchy root

    def _dir(self, rel: str) -> Path:
        layout = detect_layout(self.cgroup_root)
        if layout is None:
            raise FileNotFoundError(f"no cgroup hierarchy under {self.cgroup_root}")
        if layout.version == 2:
            return layout.root / rel
        if layout.cpuset is None:
            raise FileNotFoundError(f"no cpuset controller under {self.cgroup_root}")
        return layout.cpuset / rel

    def apply(self, container_id: str, cpus: frozenset[int], mems: frozenset[int] | None,
              reason: str, explanation: Explanation | None = None) -> MoveResult:
        # A cgroup file has nowhere to keep the explanation: it stays in the round's record.
        rel = self.resolve(container_id)
        if rel is None:
            return MoveResult(False, f"container {container_id} has no known cgroup")
        try:
            d = self._dir(rel.strip("/"))
            if not (d / "cpuset.cpus").exists():
                return MoveResult(False, f"{d}/cpuset.cpus does not exist")
            old_mems = parse_cpulist(read_text(d / "cpuset.mems") or "")
            grow = mems is not None and not mems <= old_mems
            if mems and grow:
                (d / "cpuset.mems").write_text(format_cpulist(mems | old_mems))
            (d / "cpuset.cpus").write_text(format_cpulist(cpus))
            if mems:
                (d / "cpuset.mems").write_text(format_cpulist(mems))
            now = parse_cpulist(read_text(d / "cpuset.cpus") or "")
        except (OSError, ValueError) as e:
            return MoveResult(False, f"{type(e).__name__}: {e}")
        if now != cpus:
            return MoveResult(False, f"cpuset.cpus reads back {format_cpulist(now)}, wanted {format_cpulist(cpus)}",
                              now)
        return MoveResult(True, None, now)


class MoveOutcome(BaseModel):
    container_id: str
    to_cpus: str
    to_mems: str
    result: Literal["applied", "failed", "advised"]
    error: str | None = None


class RoundRecord(BaseModel):
    time: float
    mode: str
    plan: Plan | None
    outcomes: list[MoveOutcome]
    error: str | None = None


class Rebalancer:
    """Owns the round: inputs from the store, a plan, moves, the record, the metrics."""

    def __init__(self, store: Store, topology: Callable[[], Topology], config: Callable[[], RebalancerConfig],
                 applier: Callable[[RebalancerConfig], MoveApplier | None] | None = None,
                 metadata: MetadataSource | None = None, cpusets: CpusetSource | None = None):
        """``cpusets``: the containers' current cpusets (the cgroup collector's :meth:`cpusets`); without
        it no container is planned for."""
        self.store = store
        self.topology = topology
        self.config = config
        self.applier = applier or (lambda _cfg: None)
        self.metadata = metadata
        self.cpusets = cpusets
        self.last_moved: dict[str, float] = {}
        self.history: deque[RoundRecord] = deque(maxlen=config().history_size)
        self.moves_total = {r: 0 for r in RESULTS}
        self._lock = threading.Lock()
        self._node: tuple[tuple, NodeModel] | None = None

    @property
    def last(self) -> RoundRecord | None:
        return self.history[-1] if self.history else None

    def node_model(self, cfg: RebalancerConfig, hp: frozenset[int] | None) -> NodeModel:
        topo = self.topology()
        key = (id(topo), len(topo.cpus), cfg.numa_bandwidth_bytes_per_second, cfg.l3_bandwidth_bytes_per_second)
        if self._node is None or self._node[0] != key:
            self._node = (key, NodeModel.from_topology(topo, cfg.numa_bandwidth_bytes_per_second,
                                                       cfg.l3_bandwidth_bytes_per_second))
        node = self._node[1]
        if hp is not None:
            node = dataclasses.replace(node, high_priority=np.array([int(c) in hp for c in node.cpu_ids]))
        return node

    def run_once(self, now: float | None = None, mode: str | None = None,
                 gate: RoundGate | None = None) -> RoundRecord | None:
        """One round. ``gate`` (the service's change check) is shown the round's inputs before planning; when
        it answers a reason, the round stops there: nothing is planned, recorded or written, and None is
        returned. Without a gate every round is recorded."""
        with self._lock:
            cfg = self.config()
            if self.history.maxlen != cfg.history_size:
                self.history = deque(self.history, maxlen=cfg.history_size)
            now = time.time() if now is None else now
            mode = mode or cfg.mode
            try:
                rec = self._round(cfg, now, mode, gate)
            except Exception as e:  # a failing round is recorded, the agent goes on
                log.exception("rebalancer round failed")
                rec = RoundRecord(time=now, mode=mode, plan=None, outcomes=[], error=f"{type(e).__name__}: {e}")
            if rec is None:
                return None
            self.history.append(rec)
            self._write_metrics(rec, now, cfg)
            return rec

    def _round(self, cfg: RebalancerConfig, now: float, mode: str, gate: RoundGate | None = None) -> RoundRecord | None:
        t0 = time.perf_counter()
        md = self.metadata.metadata() if self.metadata is not None else None
        # Metadata (None: no relay reachable) comes from the relay's cache; when the relay also applies the
        # moves, containers it does not know cannot be moved through it.
        inputs = read_inputs(self.store, cfg, now, self.last_moved, md,
                             only_known=md is not None and cfg.applier != "cgroup",
                             cpusets=self.cpusets() if self.cpusets is not None else None)
        if not inputs.containers:
            plan = None
            return RoundRecord(time=now, mode=mode, plan=plan, outcomes=[], error="no containers in the store yet")
        if gate is not None and gate(inputs, cfg, now, mode) is not None:
            return None
        node = self.node_model(cfg, inputs.high_priority_cpus)
        prob = Problem.build(node, inputs.containers, cfg, now=now)
        plan = Planner(cfg).plan(prob, missing_signals=inputs.missing)
        plan.duration_seconds = time.perf_counter() - t0
        outcomes = []
        applier = self.applier(cfg) if mode == "enforce" and plan.moves else None
        for m in plan.moves:
            if mode != "enforce":
                outcomes.append(MoveOutcome(container_id=m.container_id, to_cpus=m.to_cpus, to_mems=m.to_mems,
                                            result="advised"))
                continue
            if applier is None:
                res = MoveResult(False, "no move applier: the relay's move API is not available "
                                        "(set rebalancer.applier: cgroup to write cgroups directly)")
            else:
                res = applier.apply(m.container_id, parse_cpulist(m.to_cpus), parse_cpulist(m.to_mems) or None,
                                    move_why(m.reason, m.separates), Explanation.of(m.gain_by_term, m.separates))
            if res.ok:
                self.last_moved[m.container_id] = now
            else:
                log.warning("move of %s to %s failed: %s", m.container_id, m.to_cpus, res.error)
            outcomes.append(MoveOutcome(container_id=m.container_id, to_cpus=m.to_cpus, to_mems=m.to_mems,
                                        result="applied" if res.ok else "failed", error=res.error))
        for o in outcomes:
            self.moves_total[o.result] += 1
        return RoundRecord(time=now, mode=mode, plan=plan, outcomes=outcomes)

    def _write_metrics(self, rec: RoundRecord, now: float, cfg: RebalancerConfig) -> None:
        samples = [Sample(M.REBALANCER_MOVES.name, {"result": r}, float(v)) for r, v in self.moves_total.items()]
        if rec.plan is not None:
            samples += [Sample(M.REBALANCER_COST.name, {"when": "before"}, rec.plan.cost_before.total),
                        Sample(M.REBALANCER_COST.name, {"when": "after"}, rec.plan.cost_after.total),
                        Sample(M.REBALANCER_PLAN_DURATION.name, {}, rec.plan.duration_seconds)]
        self.store.append(TABLE, now, samples, cfg.interval_seconds)
