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
from dataclasses import dataclass

import numpy as np

from .model import CostModel, Problem, State


class SolverUnavailable(RuntimeError):
    pass


@dataclass
class ExactResult:
    status: str
    objective: float  # H × I + M of the solution, as the solver reports it
    rows: np.ndarray  # containers × positions: the optimal placement
    choice: dict[int, int]  # container index -> candidate index, for the moved ones
    seconds: float
    mip_gap: float


class Encoder:
    """Collects the MILP: column bounds/costs/integrality, row-wise constraints, a constant."""

    def __init__(self, prob: Problem, model: CostModel):
        self.prob, self.model = prob, model
        self.H = prob.cfg.amortization_seconds
        n = prob.n
        opt_i, opt_c, rows = [], [], []
        mov = np.flatnonzero(prob.movable) if prob.cand is not None else np.array([], dtype=np.int64)
        valid = prob.valid(mov) if len(mov) else np.zeros((0, 0), dtype=bool)
        mig = model.migration.matrix(prob, mov) if len(mov) else np.zeros((0, 0))
        self.mig_cost: list[float] = []
        for k, i in enumerate(mov):
            opt_i.append(i), opt_c.append(-1), rows.append(prob.S0[i]), self.mig_cost.append(0.0)
            for c in np.flatnonzero(valid[k]):
                opt_i.append(i), opt_c.append(int(c)), rows.append(prob.cand.rows[c]), self.mig_cost.append(float(mig[k, c]))
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

    def add_excess(self, expr: tuple[np.ndarray, np.ndarray], cap: np.ndarray, weight: np.ndarray) -> None:
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

    def add_bilinear(self, term) -> None:
        from .model import AVX, SENS

        prob = self.prob
        w = term.weight
        _, size = term._of(prob)
        D = term.domain_shares(prob, self.R)  # x-options × domains
        Df = term.domain_shares(prob, prob.S0[self.fixed]) if len(self.fixed) else np.zeros((0, len(size)))
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
    def solve(self, time_limit_seconds: float = 60.0, mip_rel_gap: float = 1e-6) -> ExactResult:
        try:
            import highspy
        except ImportError:
            raise SolverUnavailable("the exact optimum needs highspy: pip install 'cri-resmgr[bench]'") from None
        for t in self.model.active_terms(self.prob):
            t.encode(self)
        t0 = time.perf_counter()
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(time_limit_seconds))
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        h.setOptionValue("threads", 1)
        lp = highspy.HighsLp()
        nc = len(self.cost)
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
        lp.a_matrix_.index_ = np.concatenate([c[0] for c in self.constraints]).astype(np.int32) if self.constraints else np.zeros(0, np.int32)
        lp.a_matrix_.value_ = np.concatenate([c[1] for c in self.constraints]) if self.constraints else np.zeros(0)
        lp.a_matrix_.num_col_ = nc
        lp.a_matrix_.num_row_ = len(self.constraints)
        lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                           for b in self.integer]
        h.passModel(lp)
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        x = np.array(h.getSolution().col_value[: self.nx])
        info = h.getInfo()
        rows = self.prob.S0.copy()
        choice = {}
        for j in np.flatnonzero(x > 0.5):
            if self.opt_c[j] >= 0:
                rows[self.opt_i[j]] = self.R[j]
                choice[int(self.opt_i[j])] = int(self.opt_c[j])
        return ExactResult(status, float(info.objective_function_value), rows, choice,
                           time.perf_counter() - t0, float(info.mip_gap))


def optimum(prob: Problem, model: CostModel | None = None, time_limit_seconds: float = 60.0) -> ExactResult:
    return Encoder(prob, model or CostModel(prob.cfg)).solve(time_limit_seconds)


def objective_of(prob: Problem, model: CostModel, rows: np.ndarray, choice: dict[int, int]) -> float:
    """``H × I + M`` of a placement evaluated with the cost model itself (to check the solver)."""
    st = State(prob, rows.copy())
    mov = np.flatnonzero(prob.movable)
    pos = {int(i): k for k, i in enumerate(mov)}
    mig = model.migration.matrix(prob, mov) if len(mov) else np.zeros((0, 0))
    return prob.cfg.amortization_seconds * model.total(st) + sum(float(mig[pos[i], c]) for i, c in choice.items())
