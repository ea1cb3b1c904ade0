"""The exact optimum of the same cost model, as a mixed-integer linear program (HiGHS via ``highspy``).

Decision space = the planner's: each movable container stays or takes one of its valid candidates
(binary ``x``, one per option, exactly one per container); fixed containers are constants. The
objective is the planner's ``J = H × I + M`` (without its hysteresis), built from the terms' own
``encode`` methods:

- convex piecewise-linear terms (oversubscription, bandwidth, cache): one continuous excess variable
  per CPU or domain, ``e ≥ expression − capacity``, ``e ≥ 0`` — exact at the optimum;
- linear terms (latency-critical): objective coefficients;
- bilinear terms (AVX512 × sensitive per core / package): ``A_D × L_D`` with ``A_D`` a sum of
  AVX512 options' shares and ``L_D`` linear in ``x``; each product ``x_io × L_D`` is a variable ``y``
  with the McCormick bounds ``y ≥ L_D − Lmax_D (1 − x_io)``, ``y ≥ 0``, exact for binary ``x`` because
  its cost coefficient is positive.

For benchmarks and tests on small instances (≈ 24 containers); it needs ``pip install '.[bench]'``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .model import CostModel
from .problem import AVX, SENS, Problem, State


class SolverUnavailable(RuntimeError):
    pass


@dataclass
class ExactResult:
    status: str
    objective: float  # H × I + M of the solution: the constant (fixed containers) plus cost × solution
    rows: np.ndarray  # containers × positions: the optimal placement
    choice: dict[int, int]  # container index -> candidate index, for the moved ones
    seconds: float
    mip_gap: float


class Encoder:
    """Collects the MILP: column bounds/costs/integrality, row-wise constraints, a constant."""

    def __init__(self, prob: Problem, model: CostModel, migration_factor: float = 1.0, symmetry: bool = True):
        self.prob, self.model = prob, model
        self.H = prob.cfg.amortization_seconds
        n = prob.n
        opt_i: list[int] = []
        opt_c: list[int] = []
        rows: list[np.ndarray] = []
        mov = np.flatnonzero(prob.movable) if prob.cand is not None else np.array([], dtype=np.int64)
        valid = prob.valid(mov) if len(mov) else np.zeros((0, 0), dtype=bool)
        mig = migration_factor * model.migration.matrix(prob, mov) if len(mov) else np.zeros((0, 0))
        self.mig_cost: list[float] = []
        for k, i in enumerate(mov):
            opt_i.append(int(i))
            opt_c.append(-1)
            rows.append(prob.S0[i])
            self.mig_cost.append(0.0)
            for c in np.flatnonzero(valid[k]):
                opt_i.append(int(i))
                opt_c.append(int(c))
                rows.append(prob.cands.rows[c])
                self.mig_cost.append(float(mig[k, c]))
        self.opt_i = np.array(opt_i, dtype=np.int64)
        self.opt_c = np.array(opt_c, dtype=np.int64)
        self.R = np.array(rows) if rows else np.zeros((0, prob.node.ncpu))
        self.nx = len(opt_i)
        self.fixed = np.setdiff1d(np.arange(n), mov)
        self.cost = list(self.mig_cost)
        self.lower = [0.0] * self.nx
        self.upper = [1.0] * self.nx
        self.integer = [True] * self.nx
        self.constraints: list[tuple[np.ndarray, np.ndarray, float, float]] = []
        self.constant = 0.0
        for i in mov:
            idx = np.flatnonzero(self.opt_i == i)
            self._row(idx, np.ones(len(idx)), 1.0, 1.0)
        moves = np.flatnonzero(self.opt_c >= 0)
        if len(moves):
            self._row(moves, np.ones(len(moves)), 0.0, float(prob.cfg.max_moves_per_round))
        self.symmetry_rows = self._break_symmetry() if len(moves) and symmetry else 0

    # -- symmetry ----------------------------------------------------------------------------------------
    def _break_symmetry(self) -> int:
        """Order interchangeable sibling subtrees; returns the number of rows added.

        Two children of one tree node are interchangeable when exchanging them (CPU for CPU, in tree
        order) maps the problem onto itself: every CPU has the same package, NUMA node, L3 domain,
        SST-BF class, isolation, pool membership and threads per core as its image, and every
        container has the same current share on both (so fixed containers, current placements and
        migration costs agree). Exchanging them maps every candidate to a candidate and a placement to
        one of equal cost, so requiring ``moves into A ≥ moves into B`` for interchangeable siblings A
        before B (applied from the root down, each exchange keeps the constraints above it) keeps an
        optimum and cuts the mirror images the branch and bound would otherwise explore: on the
        224-CPU fixture most cores of a NUMA node are interchangeable while nothing is placed on
        them."""
        prob = self.prob
        node, cand = prob.node, prob.cands
        P = node.ncpu
        cols = np.round(prob.S0.T, 12)  # positions × containers
        cpu_key = [
            (int(node.pkg_of[p]), int(node.numa_of[p]), int(node.l3_of[p]), bool(node.high_priority[p]),
             bool(node.isolated[p]), bool(prob.pool[p]), float(node.threads_per_core[node.core_of[p]]),
             cols[p].tobytes())
            for p in range(P)
        ]
        intern: dict[object, int] = {}

        def sig_of(lo: int, hi: int) -> int:
            return intern.setdefault(tuple(cpu_key[lo:hi]), len(intern))

        children: dict[int, list[int]] = {}
        for t, tn in enumerate(node.tree):
            if tn.parent >= 0:
                children.setdefault(tn.parent, []).append(t)
        inside_lo = cand.lo[self.opt_c[self.opt_c >= 0]]
        inside_hi = cand.hi[self.opt_c[self.opt_c >= 0]]
        movers = np.flatnonzero(self.opt_c >= 0)
        added = 0
        for kids in children.values():
            groups: dict[int, list[int]] = {}
            for t in kids:
                tn = node.tree[t]
                groups.setdefault(sig_of(tn.lo, tn.hi), []).append(t)
            for same in groups.values():
                for a, b in zip(same, same[1:], strict=False):
                    ta, tb = node.tree[a], node.tree[b]
                    in_a = movers[(inside_lo >= ta.lo) & (inside_hi <= ta.hi)]
                    in_b = movers[(inside_lo >= tb.lo) & (inside_hi <= tb.hi)]
                    if len(in_a) == 0 and len(in_b) == 0:
                        continue
                    # Σ x(options inside A) − Σ x(options inside B) ≥ 0
                    self._row(np.r_[in_a, in_b], np.r_[np.ones(len(in_a)), -np.ones(len(in_b))], 0.0, np.inf)
                    added += 1
        return added

    # -- building blocks used by the terms ------------------------------------------------------------
    def _var(self, cost: float, lo: float = 0.0, hi: float = np.inf) -> int:
        self.cost.append(cost)
        self.lower.append(lo)
        self.upper.append(hi)
        self.integer.append(False)
        return len(self.cost) - 1

    def _row(self, idx, vals, lo: float, hi: float) -> None:
        idx = np.asarray(idx, dtype=np.int64)
        vals = np.asarray(vals, dtype=np.float64)
        keep = vals != 0
        self.constraints.append((idx[keep], vals[keep], lo, hi))

    def field(self, attr: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-CPU field ``F_attr = M x + c``: (M positions × x-variables, c positions)."""
        X = self.prob.X
        M = (self.R * X[self.opt_i, attr][:, None]).T
        c = self.prob.S0[self.fixed].T @ X[self.fixed, attr]
        return M, c

    def add_excess(self, expr: tuple[np.ndarray, np.ndarray], cap: np.ndarray, weight: np.ndarray | float) -> None:
        """Cost Σ_r weight_r × max(0, expr_r − cap_r) per second."""
        M, c = expr
        cap = np.broadcast_to(np.asarray(cap, dtype=np.float64), (M.shape[0],))
        weight = np.broadcast_to(np.asarray(weight, dtype=np.float64), (M.shape[0],))
        for r in range(M.shape[0]):
            nz = np.flatnonzero(M[r])
            if len(nz) == 0:
                self.constant += self.H * weight[r] * max(0.0, c[r] - cap[r])
                continue
            # Rows in bytes/s with costs per byte/s would be far outside the solver's tolerances:
            # scale the row (and so the excess variable) to units of its capacity.
            scale = max(abs(cap[r]), float(np.abs(M[r, nz]).max()), 1e-12)
            e = self._var(self.H * weight[r] * scale)
            self._row(np.r_[nz, e], np.r_[M[r, nz] / scale, -1.0], -np.inf, (cap[r] - c[r]) / scale)

    def add_linear_field(self, attr: int, field_: np.ndarray) -> None:
        M, c = self.field(attr)
        coef = self.H * (field_ @ M)
        for j in np.flatnonzero(coef):
            self.cost[j] += coef[j]
        self.constant += self.H * float(field_ @ c)

    def add_domain_product(self, shares: Callable[[np.ndarray], np.ndarray], size: np.ndarray,
                           weight: float) -> None:
        """Cost ``weight × Σ_D A_D × L_D / size_D`` per second (AVX512 load × sensitive load per domain);
        ``shares(S)`` maps share rows (… × positions) to domain shares (… × domains)."""
        prob = self.prob
        w = weight
        D = shares(self.R)  # x-options × domains
        Df = shares(prob.S0[self.fixed]) if len(self.fixed) else np.zeros((0, len(size)))
        a_x, l_x = prob.X[self.opt_i, AVX], prob.X[self.opt_i, SENS]
        A_fix = prob.X[self.fixed, AVX] @ Df
        L_fix = prob.X[self.fixed, SENS] @ Df
        self.constant += self.H * w * float((A_fix * L_fix / size).sum())
        # Linear parts: fixed AVX512 × movable sensitive, and the reverse.
        lin = self.H * w * (a_x * (D @ (L_fix / size)) + l_x * (D @ (A_fix / size)))
        for j in np.flatnonzero(lin):
            self.cost[j] += lin[j]
        # Products of a movable AVX512 option with the movable part of L_D.
        Lcoef = (l_x[:, None] * D).T  # domains × x-options: movable L_D = Lcoef @ x
        if not (l_x > 0).any():
            return
        movers = np.unique(self.opt_i[l_x > 0])
        Lmax = np.zeros(len(size))
        for i in movers:
            Lmax += Lcoef[:, self.opt_i == i].max(axis=1)
        for j in np.flatnonzero(a_x > 0):
            for d in np.flatnonzero(D[j] > 0):
                coef = self.H * w * a_x[j] * D[j, d] / size[d]
                nz = np.flatnonzero(Lcoef[d])
                nz = nz[self.opt_i[nz] != self.opt_i[j]]
                if len(nz) == 0 or coef <= 0:
                    continue
                y = self._var(coef)
                # y ≥ L_d − Lmax_d (1 − x_j)  ⇔  L_d + Lmax_d x_j − y ≤ Lmax_d
                self._row(np.r_[nz, j, y], np.r_[Lcoef[d, nz], Lmax[d], -1.0], -np.inf, Lmax[d])

    # -- solving ---------------------------------------------------------------------------------------
    def start_values(self, choice: dict[int, int]) -> np.ndarray:
        """Every column's value for a placement (container index -> candidate; the rest stay): the binary
        options, then each continuous variable (an excess or a product) at the least value its one row
        allows — a feasible incumbent to start the branch and bound from."""
        col = np.zeros(len(self.cost))
        for j in range(self.nx):
            i = int(self.opt_i[j])
            col[j] = 1.0 if int(self.opt_c[j]) == choice.get(i, -1) else 0.0
        for idx, vals, lo, hi in self.constraints:
            v = int(idx[-1])
            if v < self.nx or vals[-1] != -1.0 or np.isfinite(lo):
                continue  # a choice or move-budget row
            col[v] = max(0.0, float(vals[:-1] @ col[idx[:-1]]) - hi)
        return col

    def solve(self, time_limit_seconds: float = 60.0, mip_rel_gap: float = 1e-6,
              start: dict[int, int] | None = None) -> ExactResult:
        """``start``: a placement (e.g. the planner's) handed to HiGHS as the first incumbent."""
        try:
            import highspy
        except ImportError:
            raise SolverUnavailable("the exact optimum needs highspy: pip install 'cri-resmgr[bench]'") from None
        for t in self.model.active_terms(self.prob):
            t.encode(self)
        t0 = time.perf_counter()
        nc = len(self.cost)
        if nc == 0:
            # Nothing to decide (nothing movable, and every term a constant): HiGHS would answer
            # "Empty" with objective 0 and drop the offset, so the fixed cost is the answer itself.
            return ExactResult("Optimal", self.constant, self.prob.S0.copy(), {}, time.perf_counter() - t0, 0.0)
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(time_limit_seconds))
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        h.setOptionValue("threads", 1)
        lp = highspy.HighsLp()
        lp.num_col_ = nc
        lp.num_row_ = len(self.constraints)
        lp.col_cost_ = np.array(self.cost)
        lp.col_lower_ = np.array(self.lower)
        lp.col_upper_ = np.array(self.upper)
        lp.offset_ = self.constant
        lp.row_lower_ = np.array([c[2] for c in self.constraints])
        lp.row_upper_ = np.array([c[3] for c in self.constraints])
        starts = np.cumsum([0] + [len(c[0]) for c in self.constraints])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = starts.astype(np.int32)
        if self.constraints:
            lp.a_matrix_.index_ = np.concatenate([c[0] for c in self.constraints]).astype(np.int32)
            lp.a_matrix_.value_ = np.concatenate([c[1] for c in self.constraints])
        else:
            lp.a_matrix_.index_ = np.zeros(0, np.int32)
            lp.a_matrix_.value_ = np.zeros(0)
        lp.a_matrix_.num_col_ = nc
        lp.a_matrix_.num_row_ = len(self.constraints)
        lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                           for b in self.integer]
        h.passModel(lp)
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value = self.start_values(start).tolist()
            sol.value_valid = True
            h.setSolution(sol)
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        col = np.array(h.getSolution().col_value)
        info = h.getInfo()
        rows = self.prob.S0.copy()
        choice: dict[int, int] = {}
        if len(col) < nc:  # no solution at all (e.g. the time limit before the first incumbent)
            return ExactResult(status, float("nan"), rows, choice, time.perf_counter() - t0, float("nan"))
        x = col[: self.nx]
        for j in np.flatnonzero(x > 0.5):
            if self.opt_c[j] >= 0:
                rows[self.opt_i[j]] = self.R[j]
                choice[int(self.opt_i[j])] = int(self.opt_c[j])
        # The objective from the solution and the constant, whatever the status says of its own value.
        objective = self.constant + float(np.array(self.cost) @ col[:nc])
        return ExactResult(status, objective, rows, choice, time.perf_counter() - t0, float(info.mip_gap))


def optimum(prob: Problem, model: CostModel | None = None, time_limit_seconds: float = 60.0,
            migration_factor: float = 1.0, start: dict[int, int] | None = None) -> ExactResult:
    """The exact optimum of ``H × I + migration_factor × M`` (``1 + gain_margin``: the planner's own
    objective with its hysteresis; 1: the plain objective)."""
    return Encoder(prob, model or CostModel(prob.cfg), migration_factor).solve(time_limit_seconds, start=start)


def objective_of(prob: Problem, model: CostModel, rows: np.ndarray, choice: dict[int, int],
                 migration_factor: float = 1.0) -> float:
    """``H × I + M`` of a placement evaluated with the cost model itself (to check the solver)."""
    st = State(prob, rows.copy())
    mov = np.flatnonzero(prob.movable)
    pos = {int(i): k for k, i in enumerate(mov)}
    mig = model.migration.matrix(prob, mov) if len(mov) else np.zeros((0, 0))
    migration = sum(float(mig[pos[i], c]) for i, c in choice.items())
    return prob.cfg.amortization_seconds * model.total(st) + migration_factor * migration
