"""The exact optimum of the same cost model, as a mixed-integer linear program (HiGHS via ``highspy``).

Decision space = the planner's: each movable container stays or takes one of its valid candidates
(binary ``x``, one per option, exactly one per container); fixed containers are constants. The
objective is the planner's ``J = H × I + M`` (without its hysteresis), built from the terms' own
``encode`` methods:

- convex piecewise-linear terms (oversubscription, bandwidth, cache): one continuous variable per CPU
  or domain, ``e ≥ 0`` and ``e ≥ a_k × expression / capacity + b_k`` per segment (one segment, the
  excess over capacity, for CPU and cache; the chords of the queueing curve for bandwidth) — exact at
  the optimum;
- linear terms (latency-critical): objective coefficients;
- bilinear terms (AVX512 × sensitive per core / package): ``A_D × L_D`` written around the current
  placement, ``A0·L0 + A0·ΔL + ΔA·L0 + ΔA·ΔL``: everything but the product of two *moves* is exact and
  linear, and that product is one McCormick pair per AVX512 move option and per group of domains its
  destination covers evenly (``x_j × ΔL_G``, ΔL_G bounded by what ``max_moves_per_round`` moves can
  change). For a container spread over the whole pool, leaving costs nothing in this form (ΔL over every
  domain is zero). The first encoding (McCormick on the whole ``A_D × L_D``, ``products="plain"``) is
  kept as the reference; its LP bound was near zero on the 224-CPU fixture.

Symmetry: interchangeable sibling subtrees are ordered by their first occupant (:meth:`Encoder._break_symmetry`),
and a start is brought to that order (:meth:`Encoder.canonical`). With a start, the sub-MIP heuristics are
off (:data:`SUB_MIP_HEURISTICS`): the incumbent is there, the time goes to the proof.

For benchmarks and tests on instances of ≈ 24 containers; it needs ``pip install '.[bench]'``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .bandwidth_curve import ConvexPwl
from .model import CostModel
from .problem import AVX, SENS, Problem, State

# HiGHS options of the heuristics that solve sub-MIPs (HiGHS 1.16 option names).
SUB_MIP_HEURISTICS = ("mip_heuristic_run_rins", "mip_heuristic_run_rens", "mip_heuristic_run_root_reduced_cost")


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

    def __init__(self, prob: Problem, model: CostModel, migration_factor: float = 1.0, symmetry: bool = True,
                 products: str = "delta"):
        if products not in ("delta", "plain"):
            raise ValueError(f"products must be 'delta' or 'plain', not {products!r}")
        self.prob, self.model = prob, model
        self.products = products
        # Columns defined by equalities or products, and how to value them from a placement (a MIP start):
        # ΔL_D columns -> (indices, values, constant); products -> (binary columns summed, True: one minus
        # their sum, the ΔL_D column multiplied).
        self.ell_defs: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}
        self.product_defs: dict[int, tuple[np.ndarray, bool, int]] = {}
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
        self.groups: list[list[int]] = []
        self.symmetry_rows = self._break_symmetry() if len(moves) and symmetry else 0

    # -- symmetry ----------------------------------------------------------------------------------------
    def _sibling_groups(self) -> list[list[int]]:
        """Groups of interchangeable sibling subtrees (tree indices, in tree order), parents first.

        Two children of one tree node are interchangeable when exchanging them (CPU for CPU, in tree
        order) maps the problem onto itself: every CPU has the same package, NUMA node, L3 domain,
        SST-BF class, isolation, pool membership and threads per core as its image, and every
        container has the same current share on both (so fixed containers, current placements and
        migration costs agree). Exchanging them maps every candidate to a candidate and a placement to
        one of equal cost. On the 224-CPU fixture most cores of a NUMA node are interchangeable while
        nothing is placed on them."""
        prob = self.prob
        node = prob.node
        cols = np.round(prob.S0.T, 12)  # positions × containers
        cpu_key = [
            (int(node.pkg_of[p]), int(node.numa_of[p]), int(node.l3_of[p]), bool(node.high_priority[p]),
             bool(node.isolated[p]), bool(prob.pool[p]), float(node.threads_per_core[node.core_of[p]]),
             cols[p].tobytes())
            for p in range(node.ncpu)
        ]
        intern: dict[object, int] = {}

        def sig_of(lo: int, hi: int) -> int:
            return intern.setdefault(tuple(cpu_key[lo:hi]), len(intern))

        children: dict[int, list[int]] = {}
        for t, tn in enumerate(node.tree):
            if tn.parent >= 0:
                children.setdefault(tn.parent, []).append(t)
        out: list[list[int]] = []
        for parent in sorted(children):
            groups: dict[int, list[int]] = {}
            for t in children[parent]:
                tn = node.tree[t]
                groups.setdefault(sig_of(tn.lo, tn.hi), []).append(t)
            out += [g for g in groups.values() if len(g) > 1]
        return out

    def _break_symmetry(self) -> int:
        """Order interchangeable sibling subtrees by their first occupant; returns the rows added.

        For interchangeable siblings A before B: the first mover (in container order) placed inside A
        comes before the first placed inside B, or neither holds one — for each mover ``r``,
        ``x(r inside B) ≤ Σ_{r' < r} x(r' inside A)``. Any placement can be brought to this form by
        exchanging siblings, from the root down (sorting the siblings of a node by first occupant does
        not change which movers are inside their parent, so it keeps the order above), so an optimum is
        kept; and unlike ordering by counts it leaves no ties: with one container per core, every
        permutation of the occupied cores but one is cut. :meth:`canonical` brings a start to this form."""
        cand = self.prob.cands
        node = self.prob.node
        movers = np.flatnonzero(self.opt_c >= 0)
        c_lo, c_hi = cand.lo[self.opt_c[movers]], cand.hi[self.opt_c[movers]]
        who = self.opt_i[movers]
        order = np.unique(who)
        added = 0
        self.groups = self._sibling_groups()
        for same in self.groups:
            for a, b in zip(same, same[1:], strict=False):
                ta, tb = node.tree[a], node.tree[b]
                in_a = (c_lo >= ta.lo) & (c_hi <= ta.hi)
                in_b = (c_lo >= tb.lo) & (c_hi <= tb.hi)
                if not in_b.any():
                    continue
                for r, i in enumerate(order):
                    mine = movers[in_b & (who == i)]
                    if len(mine) == 0:
                        continue
                    before = movers[in_a & np.isin(who, order[:r])]
                    # Σ x(before, inside A) − Σ x(i inside B) ≥ 0
                    self._row(np.r_[before, mine], np.r_[np.ones(len(before)), -np.ones(len(mine))], 0.0, np.inf)
                    added += 1
        return added

    def canonical(self, choice: dict[int, int]) -> dict[int, int]:
        """The placement ``choice`` with interchangeable siblings exchanged into first-occupant order (the
        form :meth:`_break_symmetry` keeps): the same cost, and a valid start for the solver."""
        if not self.symmetry_rows:
            return dict(choice)
        cand = self.prob.cands
        node = self.prob.node
        by_interval = {(int(lo), int(hi)): c for c, (lo, hi) in enumerate(zip(cand.lo, cand.hi, strict=True))}
        out = dict(choice)
        for same in self.groups:
            lo = [node.tree[t].lo for t in same]
            hi = [node.tree[t].hi for t in same]

            slot = {i: next((k for k in range(len(same)) if cand.lo[c] >= lo[k] and cand.hi[c] <= hi[k]), -1)
                    for i, c in out.items()}
            first = [min((i for i, k2 in slot.items() if k2 == k), default=1 << 60) for k in range(len(same))]
            perm = sorted(range(len(same)), key=lambda k: (first[k], k))  # new slot q takes old slot perm[q]
            dest = {old: new for new, old in enumerate(perm)}
            for i, c in list(out.items()):
                k = slot[i]
                if k >= 0 and dest[k] != k:
                    shift = lo[dest[k]] - lo[k]
                    out[i] = by_interval[(int(cand.lo[c]) + shift, int(cand.hi[c]) + shift)]
        return out

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

    def add_convex(self, expr: tuple[np.ndarray, np.ndarray], cap: np.ndarray, curve: ConvexPwl,
                   weight: float) -> None:
        """Cost Σ_r weight × curve(expr_r / cap_r) per second for a convex piecewise-linear ``curve``
        (``max(0, max_k a_k x + b_k)``): one variable ``t_r ≥ 0`` per row, ``t_r ≥ a_k x_r + b_k`` per
        segment — exact at the optimum, since the objective pushes ``t_r`` down to the largest segment."""
        M, c = expr
        cap = np.broadcast_to(np.asarray(cap, dtype=np.float64), (M.shape[0],))
        a = np.asarray(curve.slopes)
        b = np.asarray(curve.intercepts)
        for r in range(M.shape[0]):
            nz = np.flatnonzero(M[r])
            if len(nz) == 0:
                self.constant += self.H * weight * float(curve(c[r] / cap[r]))
                continue
            t = self._var(self.H * weight)
            row = M[r, nz] / cap[r]
            for ak, bk in zip(a, b, strict=True):
                if ak == 0.0 and bk <= 0.0:
                    continue  # t ≥ 0 already
                # a (M x + c) / cap + b ≤ t  ⇔  a M/cap · x − t ≤ −b − a c / cap
                self._row(np.r_[nz, t], np.r_[ak * row, -1.0], -np.inf, -bk - ak * c[r] / cap[r])

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
        if self.products == "delta":
            self._domain_product_delta(shares, size, weight)
        else:
            self._domain_product_plain(shares, size, weight)

    def _domain_product_delta(self, shares: Callable[[np.ndarray], np.ndarray], size: np.ndarray,
                              weight: float) -> None:
        """The product written around the current placement: with ``A = A0 + ΔA`` and ``L = L0 + ΔL``
        (``A0``, ``L0``: everyone where they are; ``ΔA``, ``ΔL``: what the moves change, linear in ``x``),
        ``A·L = A0·L0 + A0·ΔL + ΔA·L0 + ΔA·ΔL``. The first three are a constant and exact linear costs;
        only the product of two *moves* needs McCormick rows. Its factor ``ΔL_D`` is bounded by what at
        most ``max_moves_per_round`` moves can change (the sum of the largest per-container changes), so
        the relaxation is tight where the budget binds. Written on the whole ``A·L`` instead
        (:meth:`_domain_product_plain`), a fractional ``x`` spread over many options makes every product
        vanish and leaves the LP bound near zero (HiGHS reported an 86 % gap after 30 s on 24 containers
        of the 224-CPU fixture); here the single-move effects, most of the objective, are exact in the LP.

        ``ΔA_D = Σ_j a_j D_jD x_j − Σ_i a_i D0_iD m_i`` (``j`` move options, ``m_i = 1 − x_stay(i)``:
        container ``i`` moved), so the products are ``x_j × ΔL_D`` for the domains a destination covers
        (positive cost: ``y ≥ lo·x_j``, ``y ≥ ΔL_D − hi·(1 − x_j)``) and ``m_i × ΔL_D`` for the domains
        it leaves (negative cost: ``z ≤ hi·m_i``, ``z ≤ ΔL_D − lo·(1 − m_i)``); exact for binary
        ``x``. Domains with the same coefficient are summed first (``ΔL_G``, one product per group), which
        tightens the bounds and makes leaving the whole pool a zero. A container is AVX512 or sensitive,
        never both, so ``ΔL`` never holds the multiplier."""
        prob = self.prob
        w = weight
        H = self.H
        D = shares(self.R)  # x-options × domains
        mov = np.unique(self.opt_i)
        D0 = shares(prob.S0[self.opt_i]) if self.nx else np.zeros((0, len(size)))  # the option's container now
        Delta = D - D0  # zero on the stay options
        a_x, l_x = prob.X[self.opt_i, AVX], prob.X[self.opt_i, SENS]
        Dall = shares(prob.S0)
        A0 = prob.X[:, AVX] @ Dall
        L0 = prob.X[:, SENS] @ Dall
        self.constant += H * w * float((A0 * L0 / size).sum())
        lin = H * w * (l_x * (Delta @ (A0 / size)) + a_x * (Delta @ (L0 / size)))
        for j in np.flatnonzero(lin):
            self.cost[j] += lin[j]
        if not (l_x > 0).any() or not (a_x > 0).any():
            return
        Lcoef = (l_x[:, None] * Delta).T  # domains × x-options: ΔL_D = Lcoef @ x
        # Written sparsely: ΔL_D = Σ_moves l D x − Σ_i l_i D0_iD (1 − x_stay(i)), so a row holds the
        # options that reach D and one column per sensitive container there now, not every option of
        # every container that could leave D (15 M nonzeros instead of 0.5 M on the 224-CPU fixture).
        Lmove = np.where(self.opt_c[:, None] >= 0, l_x[:, None] * D, 0.0).T  # domains × x-options
        Lstay = np.where(self.opt_c[:, None] < 0, l_x[:, None] * D0, 0.0).T
        Lsparse = Lmove + Lstay
        Lconst = -Lstay.sum(axis=1)
        sens_opts = [np.flatnonzero(self.opt_i == i) for i in mov if prob.X[i, SENS] > 0]
        budget = int(prob.cfg.max_moves_per_round)

        def top(v: np.ndarray, b: int) -> float:
            """Sum of the ``b`` largest entries."""
            return float(np.sort(v)[::-1][:max(0, b)].sum())

        # One column per domain for ΔL_D (an equality row), so the product rows stay short however
        # many options reach D.
        ell_d: dict[int, int] = {}
        for d in range(len(size)):
            nz = np.flatnonzero(Lsparse[d] != 0)
            if len(nz) == 0:
                continue
            v = self._var(0.0, lo=-np.inf)
            ell_d[d] = v
            self.ell_defs[v] = (nz, Lsparse[d, nz], float(Lconst[d]))
            self._row(np.r_[nz, v], np.r_[Lsparse[d, nz], -1.0], -float(Lconst[d]), -float(Lconst[d]))
        regions: dict[bytes, tuple[int, float, float, float, float] | None] = {}

        def region(G: np.ndarray) -> tuple[int, float, float, float, float] | None:
            """ΔL_G = Σ_{D∈G} ΔL_D as a column, with its bounds (hi0, lo0: at most ``budget`` sensitive
            containers moved; hi1, lo1: at most ``budget − 1``); None when it is identically zero."""
            key = G.tobytes()
            if key in regions:
                return regions[key]
            g = Lcoef[G].sum(axis=0)  # per option: its change of L over G
            keep = [d for d in G if d in ell_d]
            if not keep or np.abs(g).max(initial=0.0) <= 1e-12:
                regions[key] = None  # e.g. every core: moves only shift sensitive load around
                return None
            up = np.array([max(0.0, float(g[o].max())) for o in sens_opts])
            down = np.array([min(0.0, float(g[o].min())) for o in sens_opts])
            v = self._var(0.0, lo=-np.inf)
            cols = np.array([ell_d[d] for d in keep])
            self.ell_defs[v] = (cols, np.ones(len(cols)), 0.0)
            self._row(np.r_[cols, v], np.r_[np.ones(len(cols)), -1.0], 0.0, 0.0)
            regions[key] = (v, top(up, budget), -top(-down, budget), top(up, budget - 1), -top(-down, budget - 1))
            return regions[key]

        def groups(row: np.ndarray) -> list[tuple[float, np.ndarray]]:
            """Domains with the same share per CPU: (share / size, the domains)."""
            per = np.round(row / size, 14)
            return [(float(c), np.flatnonzero(per == c)) for c in np.unique(per[per > 0])]

        for i in mov:
            a_i = float(prob.X[i, AVX])
            if a_i <= 0:
                continue
            opts = np.flatnonzero(self.opt_i == i)
            moves, s = opts[self.opt_c[opts] >= 0], int(opts[self.opt_c[opts] < 0][0])
            # x_j × ΔL_G: AVX512 work arriving evenly in the domains G of its destination. Summed over
            # G the domain products are one product with ΔL_G, whose bounds are far tighter than the
            # sum of the domains' bounds (each moved container counts once, not once per domain).
            for j in moves:
                for per, G in groups(D[j]):
                    r = region(G)
                    if r is None:
                        continue
                    v, hi0, _, _, lo1 = r
                    y = self._var(H * w * a_i * per, lo=-np.inf)
                    self.product_defs[y] = (np.array([j]), False, v)
                    self._row(np.r_[j, y], np.r_[lo1, -1.0], -np.inf, 0.0)  # y ≥ lo1 x_j
                    # y ≥ ΔL_G − hi0 (1 − x_j)  ⇔  ΔL_G + hi0 x_j − y ≤ hi0
                    self._row(np.r_[v, j, y], np.r_[1.0, hi0, -1.0], -np.inf, hi0)
            # m_i × ΔL_G: AVX512 work leaving the domains G it is spread over now. For a container on
            # the whole pool, G is every domain and ΔL_G is zero: leaving gains only through arriving.
            for per, G in groups(D0[s]):
                r = region(G)
                if r is None:
                    continue
                v, _, lo0, hi1, _ = r
                z = self._var(-H * w * a_i * per, lo=-np.inf)
                self.product_defs[z] = (np.array([s]), True, v)
                self._row(np.r_[s, z], np.r_[hi1, 1.0], -np.inf, hi1)  # z ≤ hi1 (1 − x_s)
                # z ≤ ΔL_G − lo0 x_s  ⇔  z − ΔL_G + lo0 x_s ≤ 0
                self._row(np.r_[v, s, z], np.r_[-1.0, lo0, 1.0], -np.inf, 0.0)

    def _domain_product_plain(self, shares: Callable[[np.ndarray], np.ndarray], size: np.ndarray,
                              weight: float) -> None:
        """McCormick products on the whole ``A_D × L_D`` (the first encoding, kept as the reference the
        tests compare :meth:`_domain_product_delta` with)."""
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
            if v < self.nx or v in self.product_defs or v in self.ell_defs or vals[-1] != -1.0 or np.isfinite(lo):
                continue  # a choice, move-budget or product row
            col[v] = max(col[v], float(vals[:-1] @ col[idx[:-1]]) - hi)  # the largest of its rows, ≥ 0
        for v, (idx, vals, c) in self.ell_defs.items():
            col[v] = c + float(vals @ col[idx])
        for v, (xs, complement, ell) in self.product_defs.items():
            u = float(col[xs].sum())
            col[v] = (1.0 - u if complement else u) * col[ell]
        return col

    def solve(self, time_limit_seconds: float = 60.0, mip_rel_gap: float = 1e-6,
              start: dict[int, int] | None = None, options: dict[str, bool | float | str] | None = None) -> ExactResult:
        """``start``: a placement (e.g. the planner's) handed to HiGHS as the first incumbent;
        ``options``: further HiGHS options (e.g. ``{"output_flag": True}`` to see its log)."""
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
        if start is not None:
            # With an incumbent from the start, what is left is the proof. HiGHS's sub-MIP heuristics
            # (RINS, RENS, root reduced cost) then only look for a better solution, recursing up to 20
            # sub-MIPs deep on this model: on `mixed`, 24 containers of the 224-CPU fixture, they took
            # 19 of 24 s and found nothing, while the proof itself closed at the root node. Without a
            # start they stay on (they find the first incumbents).
            for k in SUB_MIP_HEURISTICS:
                h.setOptionValue(k, False)
        for k, v in (options or {}).items():
            h.setOptionValue(k, v)
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
            sol.col_value = self.start_values(self.canonical(start)).tolist()
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
