"""Interference terms of the cost model.

Each term is a function of the per-CPU fields ``F`` of a :class:`~.model.State` and answers three
questions, which must agree (the tests check ``delta`` against ``cost`` before and after each move, and
the MILP encoding against ``cost`` of the solver's placement):

``cost(prob, st)``
    the term's weighted cost of a placement, in cost units per second;
``delta(prob, st, rows)``
    rows × candidates: the change of ``cost`` if container ``rows[k]`` alone moved to candidate ``j``,
    vectorised over all pairs (interval sums over the tree order, see :class:`~.model.Candidates`);
``encode(enc)``
    the same cost as linear constraints of the exact MILP (:mod:`.exact`).

Bilinear terms (a product of two containers' loads) also implement ``pairs``: for them no single move
may gain (moving one AVX512 container inside a pool where scalar work is spread evenly changes nothing
until the scalar work moves away too), so the planner looks at the strongest pairs for compound moves.

Shares assume a container's work is spread evenly over its cpuset. Weights come from
``rebalancer.weights``; docs/rebalancer.md has a guide to adding a term.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import numpy as np

from ..config import RebalancerConfig
from .bandwidth_curve import HINGE, QUEUEING, ConvexPwl
from .problem import AVX, BW, DEMAND, LC, OCC, SENS, Problem, State

Expr = tuple[np.ndarray, np.ndarray]  # (rows × MILP variables, constant per row): ``M x + c``


class Encoder(Protocol):
    """What a term needs of the MILP builder (:class:`.exact.Encoder` implements it)."""

    prob: Problem

    def field(self, attr: int) -> Expr: ...

    def add_convex(self, expr: Expr, cap: np.ndarray, curve: ConvexPwl, weight: float) -> None: ...

    def add_linear_field(self, attr: int, field_: np.ndarray) -> None: ...

    def add_domain_product(self, shares: Callable[[np.ndarray], np.ndarray], size: np.ndarray,
                           weight: float) -> None: ...


class CostTerm:
    name: ClassVar[str]
    summary: ClassVar[str]  # one line for a move's reason: what got better

    def __init__(self, weight: float, cfg: RebalancerConfig):
        self.weight = float(weight)
        self.cfg = cfg

    def applies(self, prob: Problem) -> bool:
        return True

    def cost(self, prob: Problem, st: State) -> float:
        raise NotImplementedError

    def delta(self, prob: Problem, st: State, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def min_delta(self, prob: Problem, st: State, rows: np.ndarray) -> np.ndarray:
        """A lower bound, per row, of ``delta`` over all candidates: lets the planner skip rows that
        cannot hold the best move. Exact (and slow) by default; terms override it with a cheap bound."""
        return self.delta(prob, st, rows).min(axis=1)

    def pairs(self, prob: Problem, st: State, rows: np.ndarray) -> np.ndarray | None:
        """rows × rows interference between two containers (bilinear terms only)."""
        return None

    # What an antagonist's usage is measured in, for an explanation (None: the term has no pairs).
    usage_attr: ClassVar[int | None] = None

    def inflicted(self, prob: Problem, S: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The term's cost split over (antagonist, victim) pairs for placement ``S``: (rows × all: what
        each of ``rows`` inflicts on every container, rows × all: what each suffers from every
        container), cost units per second. The split of every pair term adds up to its cost."""
        return None

    def encode(self, enc: Encoder) -> None:
        raise NotImplementedError(f"{self.name} has no MILP encoding")


# -- per-CPU terms -----------------------------------------------------------------------------------
DIRECT_WORK = 24000  # rows × candidate memberships up to which Oversubscription.delta sums every candidate directly


class Oversubscription(CostTerm):
    """CPU demand beyond what the CPUs of a shared set can give.

    Per CPU, load = Σ containers demand × share, with demand = max(usage, request) (a container is
    entitled to its request and competes with what it uses). Cost = weight × Σ_cpu max(0, load −
    ``oversubscription_threshold``): CPUs of runnable work per second that wait for a CPU — the delay
    the CFS run queue adds. Convex piecewise linear: the MILP encodes it exactly with one excess
    variable per CPU.
    """

    name = "oversubscription"
    summary = "relieves oversubscribed CPUs"

    def cost(self, prob, st):
        return self.weight * np.maximum(0.0, st.F[:, DEMAND] - self.cfg.oversubscription_threshold).sum()

    def delta(self, prob, st, rows):
        # Adding ``inc`` CPUs of demand to a position of base load x costs
        # f(x) = max(x + inc, θ) − max(x, θ): inc when x ≥ θ, x + inc − θ when θ − inc < x < θ, else 0.
        # The base load is the current load less the row's own share. Small candidates (most of them:
        # cores and threads) sum f over their few CPUs directly, and so do all candidates for a few rows.
        # Else, over a large one the sum needs only its loads in sorted order and their prefix sums (two
        # binary searches per (row, candidate)), not a pass over its CPUs; the row's own share, uniform
        # over its cpuset, is a shifted threshold θ + δ when the cpuset holds the whole pool, else an
        # explicit correction over the cpuset's positions.
        th = self.cfg.oversubscription_threshold
        cand = prob.cands
        out = np.zeros((len(rows), cand.n))
        d = prob.X[rows, DEMAND]
        live = np.flatnonzero(d > 0)
        if len(live) == 0:
            return out
        r, d = rows[live], d[live]
        load = st.F[:, DEMAND]
        S = st.S[r]
        removal = self._removal(load, S, d)
        pool = cand.pool > 0
        xmax, keys, cs, end, M = st.memo(self.name, lambda: self._sorted(cand, load))
        if float(xmax.max()) + float(d.max()) / float(cand.size.min()) <= th:
            out[live] = removal[:, None]  # no CPU of the pool can cross the threshold: adding is free
            return self.weight * out
        # Only candidates holding a CPU that the largest increment can push over θ can cost anything
        # (the base load is at most the load): the others add nothing, for every row.
        relevant = xmax + float(d.max()) / cand.size > th
        inc = d[:, None] / cand.size[None, :]
        add = np.zeros((len(r), cand.n))
        # Few rows (a lazy scan's chunk): every candidate directly, as it costs less than sorting.
        direct = relevant & (cand.few | (len(r) * len(cand.member_pos) <= DIRECT_WORK))
        if direct.any():
            if np.array_equal(direct, cand.few):
                mc, mp, starts = cand.few_cand, cand.few_pos, cand.few_start
            elif direct.all():
                mc, mp, starts = cand.member_cand, cand.member_pos, cand.member_start[:-1]
            else:
                m = direct[cand.member_cand]
                mc, mp = cand.member_cand[m], cand.member_pos[m]
                starts = np.flatnonzero(np.r_[True, mc[1:] != mc[:-1]])
            # Members × rows: the sums over each candidate's members run along contiguous memory.
            base = load[mp][:, None] - S.T[mp] * d[None, :]
            im = d[None, :] / cand.size[mc][:, None]
            f = np.maximum(base + im, th) - np.maximum(base, th)
            add[:, mc[starts]] = np.add.reduceat(f, starts, axis=0).T
        many = relevant & ~direct
        rel = np.flatnonzero(many)
        if len(rel):
            share = S.max(axis=1)
            delta_own = share * d  # the row's own load on each CPU of its cpuset
            support = S > 0
            whole = (support | ~pool[None, :]).all(axis=1)
            theta = th + np.where(whole, delta_own, 0.0)
            jm = (rel * M)[None, :]
            inc_r = inc[:, rel]
            lo_q = jm + np.clip(theta[:, None] - inc_r, -0.5, M - 1.5)
            hi_q = jm + np.clip(np.broadcast_to(theta[:, None], inc_r.shape), -0.5, M - 1.5)
            a = np.searchsorted(keys, lo_q, side="right")
            b = np.searchsorted(keys, hi_q, side="left")
            add[:, rel] = inc_r * (end[rel][None, :] - b) + (cs[b] - cs[a]) - (b - a) * (theta[:, None] - inc_r)
            # Correction on the CPUs of a row's own cpuset in the pool, for every large candidate holding
            # them (a CPU lies in a few: as many as the tree has levels above its small nodes).
            kk, pp = np.nonzero(support & pool[None, :] & ~whole[:, None])
            if len(kk):
                q, jj = cand.holding(pp, many=True)
                keep = many[jj]
                q, jj = q[keep], jj[keep]
                k3, x0 = kk[q], load[pp[q]]
                xb = x0 - delta_own[k3]
                i3 = inc[k3, jj]
                corr = (np.maximum(xb + i3, th) - np.maximum(xb, th)) - (np.maximum(x0 + i3, th) - np.maximum(x0, th))
                add += np.bincount(k3 * cand.n + jj, weights=corr, minlength=add.size).reshape(add.shape)
        out[live] = add + removal[:, None]
        return self.weight * out

    @staticmethod
    def _sorted(cand, load: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
        """Per placement: the largest load (≥ 0) of each candidate's CPUs, and for the large candidates,
        their loads in sorted order as one array of keys candidate × M + load, with prefix sums and
        where each candidate's keys end."""
        x = np.maximum(load[cand.member_pos], 0.0)
        xmax = np.maximum.reduceat(x, cand.member_start[:-1])
        m = ~cand.few[cand.member_cand]
        mc, xm = cand.member_cand[m], x[m]
        M = float(xm.max(initial=0.0)) + 2.0
        keys = mc * M + xm
        order = np.argsort(keys, kind="stable")
        keys, xs = keys[order], xm[order]
        cs = np.zeros(len(xs) + 1)
        np.cumsum(xs, out=cs[1:])
        end = np.searchsorted(keys, (np.arange(cand.n) + 1) * M - 1.0, side="right")
        return xmax, keys, cs, end, M

    def _removal(self, load: np.ndarray, S: np.ndarray, d: np.ndarray) -> np.ndarray:
        """Per row, the change of Σ max(0, load − θ) when row ``k`` (shares ``S[k]``, demand ``d[k]``)
        leaves: only CPUs above θ can change."""
        th = self.cfg.oversubscription_threshold
        hot = np.flatnonzero(load > th)
        if len(hot) == 0:
            return np.zeros(len(d))
        x = load[hot]
        return (np.maximum(x[None, :] - S[:, hot] * d[:, None], th) - x[None, :]).sum(axis=1)

    usage_attr = DEMAND

    def inflicted(self, prob, S, rows):
        # A CPU's excess split over pairs by their shares of its load: excess × (own_a / load) × (own_v / load).
        own = S * prob.X[:, DEMAND][:, None]
        load = own.sum(axis=0)
        excess = np.maximum(0.0, load - self.cfg.oversubscription_threshold)
        hot = np.flatnonzero(excess > 0)
        if len(hot) == 0:
            z = np.zeros((len(rows), len(S)))
            return z, z
        frac = own[:, hot] / load[hot]
        m = self.weight * (frac[rows] * excess[hot]) @ frac.T
        return m, m

    def min_delta(self, prob, st, rows):
        # Adding demand never lowers Σ max(0, load − θ): the removal from the current cpuset bounds the gain.
        d = prob.X[rows, DEMAND]
        out = np.zeros(len(rows))
        live = np.flatnonzero(d > 0)
        if len(live):
            out[live] = self._removal(st.F[:, DEMAND], st.S[rows[live]], d[live])
        return self.weight * out

    def encode(self, enc):
        # weight × max(0, load − θ) = weight × θ × max(0, load / θ − 1): the hinge in units of θ.
        th = self.cfg.oversubscription_threshold
        enc.add_convex(enc.field(DEMAND), np.full(enc.prob.node.ncpu, th), HINGE, self.weight * th)


class LatencyCritical(CostTerm):
    """Latency-critical work off SST-BF high-priority cores.

    Intel SST-BF raises the guaranteed (base) frequency of some cores at the expense of the others;
    the high-priority ones are those whose ``base_frequency`` is above the package's lowest
    (Documentation/admin-guide/pm/intel-speed-select.rst). Containers annotated
    ``cri-resmgr.io/latency-critical=true`` want them. Cost = weight × Σ latency-critical demand ×
    share on CPUs that are not high priority: CPUs of latency-critical work running at the lower
    base frequency. Linear. Only on nodes where SST-BF shows (else it would only push for nothing).
    """

    name = "latency_critical"
    summary = "puts latency-critical work on SST-BF high-priority cores"

    def applies(self, prob):
        return prob.node.has_sst_bf

    def _field(self, prob) -> np.ndarray:
        return 1.0 - prob.node.high_priority.astype(np.float64)

    def cost(self, prob, st):
        return self.weight * float(st.F[:, LC] @ self._field(prob))

    def _means(self, prob, st) -> tuple[np.ndarray, np.ndarray]:
        """The field and its mean over each candidate (it depends on the node only)."""
        return st.memo(self.name, lambda: (self._field(prob), prob.cands.mean(self._field(prob))))

    def delta(self, prob, st, rows):
        f, mean = self._means(prob, st)
        lc = prob.X[rows, LC]
        return self.weight * lc[:, None] * (mean[None, :] - (st.S[rows] @ f)[:, None])

    def min_delta(self, prob, st, rows):
        f, mean = self._means(prob, st)
        lc = prob.X[rows, LC]
        return self.weight * lc * (mean.min() - st.S[rows] @ f)

    def encode(self, enc):
        enc.add_linear_field(LC, self.weight * self._field(enc.prob))


class _Bilinear(CostTerm):
    """AVX512 load × latency-sensitive load per topology domain (core or package), over the domain size.

    AVX512 instructions lower the frequency of the core that runs them — the "AVX-512 license" of
    Intel's Optimization Reference Manual (§ "Processor frequency and AVX-512") — and with it the
    other hardware thread of that core; package-wide they draw from one power and thermal budget, so
    turbo headroom shrinks for every core. The harm to a non-AVX512 latency-sensitive container is
    the part of its work that runs while AVX512 work is active next to it. Per domain D:
    ``A_D × L_D / threads_D`` — A the AVX512 load (CPUs of work of containers whose AVX512 ratio is at
    least ``avx512_threshold`` or that carry the ``cri-resmgr.io/avx512`` hint), L the latency-sensitive
    load (usage × QoS sensitivity, × ``latency_critical_factor`` when annotated; BestEffort counts
    ``besteffort_sensitivity``), so A/threads is the chance a thread of D runs AVX512 code. A container
    is either AVX512 or sensitive, never both, so there is no self term. Bilinear: the MILP uses one
    product variable per pair of placements that share a domain.
    """

    level: ClassVar[str]

    def domain_of(self, prob: Problem) -> tuple[np.ndarray, np.ndarray]:
        """(domain index per position, CPUs per domain)."""
        n = prob.node
        if self.level == "core":
            return n.core_of, n.threads_per_core
        return n.pkg_of, n.pkg_cpus

    def _loads(self, prob, st):
        of, size = self.domain_of(prob)
        A = np.bincount(of, weights=st.F[:, AVX], minlength=len(size))
        L = np.bincount(of, weights=st.F[:, SENS], minlength=len(size))
        return A, L, of, size

    def cost(self, prob, st):
        A, L, _, size = self._loads(prob, st)
        return self.weight * float((A * L / size).sum())

    def _fields(self, prob, st) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(sensitive, AVX512) load per thread of each position's domain, and their means over each
        candidate: the same for every row until the placement changes."""
        def make():
            A, L, of, size = self._loads(prob, st)
            Lf, Af = (L / size)[of], (A / size)[of]
            return Lf, Af, prob.cands.mean(Lf), prob.cands.mean(Af)
        return st.memo(self.name, make)

    def delta(self, prob, st, rows):
        Lf, Af, mL, mA = self._fields(prob, st)
        a, sens = prob.X[rows, AVX], prob.X[rows, SENS]
        S = st.S[rows]
        return self.weight * (a[:, None] * (mL[None, :] - (S @ Lf)[:, None])
                              + sens[:, None] * (mA[None, :] - (S @ Af)[:, None]))

    def min_delta(self, prob, st, rows):
        Lf, Af, mL, mA = self._fields(prob, st)
        a, sens = prob.X[rows, AVX], prob.X[rows, SENS]
        S = st.S[rows]
        return self.weight * (a * (mL.min() - S @ Lf) + sens * (mA.min() - S @ Af))

    def domain_shares(self, prob, S: np.ndarray) -> np.ndarray:
        n = prob.node
        if self.level == "core":
            # Threads of a core are consecutive in tree order: sums of runs, not a product with the
            # positions × cores one-hot matrix; with t threads in every core, t strided slices (on 224
            # CPUs ~20× faster than either).
            t = int(n.threads_per_core[0])
            if (n.threads_per_core == t).all():
                out = S[:, 0::t].copy()
                for k in range(1, t):
                    out += S[:, k::t]
                return out
            return np.add.reduceat(S, n.core_starts, axis=1) if S.shape[0] else S @ n.onehot_core
        return S @ n.onehot_pkg

    def pairs(self, prob, st, rows):
        a, sens = prob.X[rows, AVX], prob.X[rows, SENS]
        ia, il = np.flatnonzero(a > 0), np.flatnonzero(sens > 0)
        if len(ia) == 0 or len(il) == 0:
            return None
        _, size = self.domain_of(prob)
        Da = self.domain_shares(prob, st.S[rows[ia]])
        Dl = self.domain_shares(prob, st.S[rows[il]])
        out = np.zeros((len(rows), len(rows)))
        out[np.ix_(ia, il)] = self.weight * ((a[ia, None] * Da / size) @ (sens[il, None] * Dl).T)
        return out

    usage_attr = AVX

    def inflicted(self, prob, S, rows):
        # Antagonist a (AVX512 load), victim v (sensitive load): w × a_a × l_v × Σ_D D_a D_v / size_D.
        _, size = self.domain_of(prob)
        D = self.domain_shares(prob, S)
        a, sens = prob.X[:, AVX], prob.X[:, SENS]
        A = a[:, None] * D / size
        L = sens[:, None] * D
        return self.weight * (A[rows] @ L.T), self.weight * (L[rows] @ A.T)

    def encode(self, enc):
        enc.add_domain_product(lambda S: self.domain_shares(enc.prob, S), self.domain_of(enc.prob)[1], self.weight)


class Avx512Core(_Bilinear):
    name = "avx512_core"
    summary = "keeps AVX512 work off cores shared with latency-sensitive work"
    level = "core"


class Avx512Package(_Bilinear):
    name = "avx512_package"
    summary = "keeps AVX512 work out of packages busy with latency-sensitive work"
    level = "package"


# -- per-domain convex terms -------------------------------------------------------------------------
def _domain_convex_delta(load: np.ndarray, cap: np.ndarray, v: np.ndarray, share_r: np.ndarray,
                         unique: tuple[np.ndarray, np.ndarray], curve: ConvexPwl) -> np.ndarray:
    """Δ Σ_D curve(load_D / cap_D) when a container with value ``v`` moves from ``share_r`` (rows ×
    domains) to each candidate, whose shares are given as (distinct rows, index per candidate)."""
    u, inv = unique
    base = load[None, :] - share_r * v[:, None]
    f_base = curve(base / cap)
    removal = f_base.sum(axis=1) - curve(load / cap).sum()
    add = (curve((base[:, None, :] + v[:, None, None] * u[None, :, :]) / cap) - f_base[:, None, :]).sum(axis=2)
    return removal[:, None] + add[:, inv]


def _domain_removal(load, cap, v, share_r, curve: ConvexPwl) -> np.ndarray:
    base = load[None, :] - share_r * v[:, None]
    return curve(base / cap).sum(axis=1) - curve(load / cap).sum()


class _DomainExcess(CostTerm):
    """Σ_domain curve(load / capacity) for a convex, non-decreasing piecewise-linear ``curve`` with
    ``curve(0) = 0`` (:class:`~.bandwidth_curve.ConvexPwl`): the hinge ``max(0, x − 1)`` by default."""

    attr: ClassVar[int]
    curve: ClassVar[ConvexPwl] = HINGE

    def domains(self, prob) -> list[tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]]:
        """(onehot positions × domains, capacity per domain, (distinct candidate share rows, index per
        candidate)) for each kind of domain the term covers."""
        raise NotImplementedError

    def applies(self, prob):
        return bool(self.domains(prob))

    def _scale(self) -> float:
        """A factor on the whole term (cost, deltas, split, encoding) besides its weight."""
        return 1.0

    def inflicted(self, prob, S, rows):
        # A domain's cost split over pairs by their shares of its load, as for oversubscription.
        m = np.zeros((len(rows), len(S)))
        v = prob.X[:, self.attr]
        for onehot, cap, _ in self.domains(prob):
            own = (S @ onehot) * v[:, None]
            load = own.sum(axis=0)
            excess = self.curve(load / cap)
            hot = np.flatnonzero(excess > 0)
            if len(hot):
                frac = own[:, hot] / load[hot]
                m += (frac[rows] * excess[hot]) @ frac.T
        m *= self.weight * self._scale()
        return m, m

    def cost(self, prob, st):
        tot = 0.0
        for onehot, cap, _ in self.domains(prob):
            load = st.F[:, self.attr] @ onehot
            tot += float(self.curve(load / cap).sum())
        return self.weight * tot * self._scale()

    def delta(self, prob, st, rows):
        out = np.zeros((len(rows), prob.cands.n))
        v = prob.X[rows, self.attr]
        live = np.flatnonzero(v > 0)
        if len(live) == 0:
            return out
        S = st.S[rows[live]]
        for onehot, cap, unique in self.domains(prob):
            load = st.F[:, self.attr] @ onehot
            out[live] += _domain_convex_delta(load, cap, v[live], S @ onehot, unique, self.curve)
        return self.weight * out * self._scale()

    def min_delta(self, prob, st, rows):
        # The curve is non-decreasing: adding load never lowers it, so the removal bounds the gain.
        out = np.zeros(len(rows))
        v = prob.X[rows, self.attr]
        live = np.flatnonzero(v > 0)
        if len(live) == 0:
            return out
        S = st.S[rows[live]]
        for onehot, cap, _ in self.domains(prob):
            out[live] += _domain_removal(st.F[:, self.attr] @ onehot, cap, v[live], S @ onehot, self.curve)
        return self.weight * out * self._scale()

    def encode(self, enc):
        M, c = enc.field(self.attr)
        for onehot, cap, _ in self.domains(enc.prob):
            enc.add_convex((onehot.T @ M, onehot.T @ c), cap, self.curve, self.weight * self._scale())


class MemoryBandwidth(_DomainExcess):
    """Memory-bandwidth demand beyond a NUMA node's (and, when configured, an L3 domain's) capacity.

    With local allocation (mems follow the CPUs), a container draws its bandwidth — MBM
    ``mbm_total_bytes`` rate, else LLC misses × 64 bytes — from the nodes it runs on, in proportion to
    its share there. The domain queues: its latency grows with its utilisation long before the
    demand reaches its capacity (``numa_bandwidth_bytes_per_second``, the peak a saturating streaming
    workload reaches), every memory-bound container there issues its requests more slowly, and the
    domain delivers less than is asked of it. Cost = weight × Σ_domain lost(demand / capacity), the
    bandwidth lost to queueing in capacities (:mod:`.bandwidth_curve`: a published loaded-latency curve
    in a closed loop; ≈ demand / capacity − 1 far beyond capacity, so one full capacity of excess
    still costs ``weight``). On parts where an L3 domain has its own link to memory (AMD CCDs),
    ``l3_bandwidth_bytes_per_second`` caps each L3 domain too. Convex piecewise linear (chords of the
    curve): the MILP writes it exactly.
    """

    name = "memory_bandwidth"
    summary = "spreads memory-bandwidth demand beyond a NUMA node's or L3 domain's capacity"
    attr = BW
    usage_attr = BW
    curve = QUEUEING

    def domains(self, prob):
        n, c = prob.node, prob.cand
        out = [(n.onehot_numa, n.numa_bandwidth, c.unique_numa if c is not None else None)]
        if n.l3_bandwidth is not None and np.isfinite(n.l3_bandwidth).any():
            keep = np.isfinite(n.l3_bandwidth)
            shares = None
            if c is not None:
                u, inv = c.unique_l3
                shares = (u[:, keep], inv)
            out.append((n.onehot_l3[:, keep], n.l3_bandwidth[keep], shares))
        return out


class CacheOccupancy(_DomainExcess):
    """Cache-occupancy pressure per L3 domain.

    The L3 occupancy a container holds (CMT ``llc_occupancy``) is the working set it keeps warm; when
    the occupancy of the containers sharing an L3 domain exceeds ``cache_pressure_threshold`` × its
    size, they evict each other's lines and every miss goes to memory. Cost = weight × Σ_L3
    max(0, occupancy − threshold × size) / size. Measured occupancy can only approach the size, so
    this term is the *prediction* for a move: a thrasher carried into an L3 that is already full.
    Convex piecewise linear.
    """

    name = "cache_occupancy"
    summary = "relieves cache-occupancy pressure in an L3 domain"
    attr = OCC
    usage_attr = OCC

    def _scale(self) -> float:
        return self.cfg.cache_pressure_threshold

    def domains(self, prob):
        n, c = prob.node, prob.cand
        keep = n.l3_size_bytes > 0
        if not keep.any():
            return []
        # Written as excess over an effective capacity (threshold × size) divided by the size.
        cap = self.cfg.cache_pressure_threshold * n.l3_size_bytes[keep]
        shares = None
        if c is not None:  # no candidates (empty pool): costs only, no deltas
            u, inv = c.unique_l3
            shares = (u[:, keep], inv)
        return [(n.onehot_l3[:, keep], cap, shares)]


TERMS: tuple[type[CostTerm], ...] = (Avx512Core, Avx512Package, MemoryBandwidth, CacheOccupancy,
                                     LatencyCritical, Oversubscription)


def default_terms(cfg: RebalancerConfig) -> list[CostTerm]:
    w = cfg.weights
    return [t(getattr(w, t.name), cfg) for t in TERMS]
