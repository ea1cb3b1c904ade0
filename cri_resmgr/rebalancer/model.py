"""The cost model: the weighted interference terms of :mod:`.terms` and the one-off cost of a move.

The inputs (containers, the node in tree order, candidates, a problem and a placement state) live in
:mod:`.problem`; the interference terms in :mod:`.terms`. Every term is a function of the per-CPU
fields of a :class:`~.problem.State`; the objective of a plan is ``J = amortization_seconds ×
I(after) + Σ migration cost`` (docs/rebalancer.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import RebalancerConfig
from . import terms as T
from .problem import BW, OCC, Problem, State


# -- cost aggregation and migration -------------------------------------------------------------------
class CostModel:
    """The weighted interference terms of :mod:`.terms` for one configuration."""

    def __init__(self, cfg: RebalancerConfig, terms: list[T.CostTerm] | None = None):
        self.cfg = cfg
        self.terms = terms if terms is not None else T.default_terms(cfg)
        self.migration = MigrationCost(cfg)
        self._active: tuple[Problem, list[T.CostTerm]] | None = None

    def active_terms(self, prob: Problem) -> list[T.CostTerm]:
        # Asked at every step of a search: remembered for the last problem (a term's applicability
        # depends only on the node and the configuration).
        if self._active is None or self._active[0] is not prob:
            self._active = (prob, [t for t in self.terms if t.weight > 0 and t.applies(prob)])
        return self._active[1]

    def evaluate(self, st: State) -> dict[str, float]:
        return {t.name: float(t.cost(st.prob, st)) for t in self.active_terms(st.prob)}

    def total(self, st: State) -> float:
        return float(sum(self.evaluate(st).values()))

    def delta(self, st: State, rows: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Change of interference (per second) if container ``rows[k]`` moved to candidate ``j``."""
        parts = {t.name: t.delta(st.prob, st, rows) for t in self.active_terms(st.prob)}
        total = np.zeros((len(rows), st.prob.cands.n))
        for v in parts.values():
            total += v
        return total, parts


@dataclass(frozen=True)
class MigrationBreakdown:
    disruption: float
    rewarm: float
    remote_memory: float

    @property
    def total(self) -> float:
        return self.disruption + self.rewarm + self.remote_memory


class MigrationCost:
    """One-off cost of moving a container (cost units, like ``amortization_seconds`` of interference).

    - **disruption** (``migration.disruption``): fixed — an update through the runtime, threads
      migrated, a latency blip.
    - **cache re-warm** (``migration.rewarm``): the share of the container's cache occupancy that lands
      in another L3 domain must be fetched again, taking ``occupancy / bandwidth`` seconds (its own
      measured bandwidth, at least ``rewarm_bandwidth_floor_bytes_per_second``) during which its
      ``usage`` CPUs run slowly: CPU-seconds lost = usage × moved occupancy / bandwidth.
    - **remote memory** (``migration.remote_memory``): pages stay on the NUMA nodes they were
      allocated on — cgroup v1 moves them only with ``cpuset.memory_migrate`` (off by default,
      Documentation/admin-guide/cgroup-v1/cpusets.rst §1.9), and cgroup v2 migration of
      ``cpuset.mems`` "may not be complete" (cgroup-v2.rst, "Cpuset Interface Files"). For
      ``remote_memory_seconds`` its traffic (GB/s) pays the extra NUMA distance
      (SLIT / 10 − 1: 0.1 to an SNC sibling, 1.1 across sockets with the usual 21).
    """

    def __init__(self, cfg: RebalancerConfig):
        self.c = cfg.migration

    def _factors(self, prob: Problem, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        X = prob.X[rows]
        bw = X[:, BW]
        floor = self.c.rewarm_bandwidth_floor_bytes_per_second
        rewarm = self.c.rewarm * prob.usage[rows] * X[:, OCC] / np.maximum(bw, floor)
        remote = self.c.remote_memory * bw / 1e9 * self.c.remote_memory_seconds
        return rewarm, remote

    def matrix(self, prob: Problem, rows: np.ndarray) -> np.ndarray:
        """rows × candidates: the cost of moving each container from its *original* placement."""
        node, cand = prob.node, prob.cands
        S0 = prob.S0[rows]
        rewarm, remote = self._factors(prob, rows)
        l3 = S0 @ node.onehot_l3
        u, inv = cand.unique_l3
        overlap = np.minimum(l3[:, None, :], u[None, :, :]).sum(axis=2)[:, inv]
        extra = np.maximum(node.numa_distance - 1.0, 0.0)
        numa = (S0 @ node.onehot_numa) @ extra @ cand.share_numa.T
        return self.c.disruption + rewarm[:, None] * np.clip(1.0 - overlap, 0.0, 1.0) + remote[:, None] * numa

    def single(self, prob: Problem, i: int, old: np.ndarray, new: np.ndarray) -> MigrationBreakdown:
        if np.array_equal(old, new):
            return MigrationBreakdown(0.0, 0.0, 0.0)
        node = prob.node
        rewarm, remote = self._factors(prob, np.array([i]))
        overlap = np.minimum(old @ node.onehot_l3, new @ node.onehot_l3).sum()
        extra = np.maximum(node.numa_distance - 1.0, 0.0)
        numa = (old @ node.onehot_numa) @ extra @ (new @ node.onehot_numa)
        return MigrationBreakdown(self.c.disruption, float(rewarm[0] * max(0.0, min(1.0, 1.0 - overlap))),
                                  float(remote[0] * numa))
