"""Planner: moves whose predicted gain pays for their migration.

Best-improvement descent on ``J = H × I + (1 + gain_margin) × M`` (H = ``amortization_seconds``, I the
interference rate, M the migration cost of the containers moved so far, from their original place):

1. *Single moves.* Every (movable container, candidate) pair is scored as ``−H × ΔI − (1 + margin) ×
   ΔM``. Rows are visited in the order of an upper bound of their best score (from each term's
   ``min_delta``) and the scan stops when no remaining row can beat the best found. On very large
   problems the bounds are taken once, at the root, and then each row's last evaluated score stands
   for its bound (lazily, as in lazy greedy).
2. *Pairs* (swaps and two-move chains). Bilinear terms have plateaus — moving one AVX512 container out
   of a pool where scalar work is spread evenly gains nothing until scalar work leaves its new place
   too — and some moves pay only after another makes room. On small problems a pair is looked for at
   every step (every row, its best destinations of distinct score, then the best second move) and
   taken when it beats the best single move followed by the best move after it; on large problems
   when no single move pays.
3. *Replacements.* With the move budget spent, a moved container may go home and free its move for
   another (a pair whose first move is the return): a binding ``max_moves_per_round`` is not left to
   the greedy's first, myopic choices. Small problems also restart from their best first moves.
4. *Chains* (small problems): a moved container goes home and the best pair follows —
   a replacement whose newcomer pays only once a moved container's place changes too.
5. *Group kicks* (small problems): the containers sharing a place move together to another candidate,
   then single moves descend from there; the best result is kept when it gains (iterated local
   search over plateaus and ridges that no short sequence of moves crosses).

Every accepted step (pair, chain, kicked descent) lowers ``J`` by more than ``min_net_gain``, so there
are finitely many, no cycle is possible, and the plan is never worse than doing nothing:
``H × I(after) + M ≤ H × I(before)``.
Hysteresis is the margin and the minimum gain; containers in cool-down, exclusive ones (unless
``move_exclusive``) and opted-out ones do not move; at most ``max_moves_per_round`` containers move.
A container may be moved twice within a round (its migration is counted once, from where it was).
The order of containers is their id, all ties break by position, and every limit counts work, not
time: the same input gives the same plan.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel
from threadpoolctl import ThreadpoolController

from ..config import RebalancerConfig
from ..sysfs import format_cpulist
from .explain import Separation, separations
from .model import CostModel
from .problem import Problem, State

CHUNK = 48  # rows evaluated together when scanning in bound order
LAZY_CHUNK = 16  # ... and first in hint order (large problems)
PAIRS = 4  # strongest bilinear pairs whose members are tried as first moves
FIRST_MOVES = 12  # rows tried as the first of two moves when no single move pays
PAIR_FIRST = 2  # destinations tried per first move on large problems
PAIR_FIRST_SMALL = 6  # ... and on small problems
REPLACE_TRIALS = 4  # large problems: weakest moves tried as replacements once the budget is spent
MULTI_START = 3  # small problems: first moves the search starts again from
PAIR_WORK = 150000  # movable² × candidates (the work of one pair search) up to which a problem is small
SMALL_ROWS = CHUNK  # ... and movable rows up to which it is (a second move's scan is one evaluation; above, a pair
# search is ~rows × destinations scans of rows / CHUNK evaluations each, and 200 containers with 3 candidates
# (a 2-CPU node) took 6 s a round)
LAZY_WORK = 40000  # movable × candidates above which rows are scanned lazily (see _Search.hint)
BEAM_MAX = 4  # widest beam of move sequences
BEAM_WORK = 4000  # (movable containers × candidates) below which the beam widens
KICK_GROUPS = 6  # small problems: groups of containers sharing a place tried as group relocations
KICK_ROUNDS = 2  # ... rounds of them


class CostSummary(BaseModel):
    total: float
    terms: dict[str, float]


class MigrationModel(BaseModel):
    disruption: float
    rewarm: float
    remote_memory: float


class MoveModel(BaseModel):
    container_id: str
    name: str
    namespace: str
    pod: str
    from_cpus: str
    to_cpus: str
    to_mems: str
    destination: str  # the topology node moved to, e.g. "package 1/numa 2"
    reason: str
    reasons: dict[str, float]  # term -> change of its cost per second (negative: better)
    gain_by_term: dict[str, float] = {}  # term -> predicted gain over amortization_seconds (positive: better)
    separates: list[Separation] = []  # the victim/antagonist pairs the move separates, largest first
    gain_per_second: float
    predicted_gain: float  # gain_per_second × amortization_seconds
    migration_cost: float
    migration: MigrationModel


class Plan(BaseModel):
    moves: list[MoveModel]
    cost_before: CostSummary
    cost_after: CostSummary
    migration_cost: float
    amortization_seconds: float
    objective_before: float  # amortization_seconds × cost_before.total
    objective_after: float  # amortization_seconds × cost_after.total + migration_cost
    containers: int
    movable: int
    fixed: dict[str, int]
    missing_signals: list[str] = []
    notes: list[str] = []
    duration_seconds: float = 0.0


@dataclass
class _Step:
    row: int
    cand: int
    score: float
    parts: dict[str, float]
    enables: int | None = None  # for the first move of a pair: the row whose move it makes pay


@dataclass
class _Search:
    prob: Problem
    st: State
    mov: np.ndarray  # movable container indices
    mig: np.ndarray  # len(mov) × candidates, from the original placement
    valid: np.ndarray
    min_mig: np.ndarray
    placed: np.ndarray  # per len(mov): candidate index, or -1 for the original placement
    steps: list[_Step] = field(default_factory=list)
    value: float = 0.0  # sum of the scores of the steps taken
    # Large problems: per row, its best score when last evaluated, else its bound at the root (+inf:
    # moved since). Rows are scanned in the order of their hint: lazy, as in lazy greedy.
    hint: np.ndarray | None = None

    def clone(self) -> _Search:
        return _Search(self.prob, self.st.copy(), self.mov, self.mig, self.valid, self.min_mig,
                       self.placed.copy(), list(self.steps), self.value,
                       None if self.hint is None else self.hint.copy())


_CONTROLLER: ThreadpoolController | None = None


def _blas() -> ThreadpoolController:
    global _CONTROLLER
    if _CONTROLLER is None:
        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER


class Planner:
    def __init__(self, cfg: RebalancerConfig, model: CostModel | None = None):
        self.cfg = cfg
        self.model = model or CostModel(cfg)

    # -- public --------------------------------------------------------------------------------------
    def plan(self, prob: Problem, missing_signals: list[str] | None = None) -> Plan:
        # The search does many small matrix products: a threaded BLAS spends more CPU coordinating its
        # threads than computing (on a loaded 2-CPU node, ~2x the CPU time of one thread).
        with _blas().limit(limits=1, user_api="blas"):
            return self._plan(prob, missing_signals)

    def _plan(self, prob: Problem, missing_signals: list[str] | None) -> Plan:
        t0 = time.perf_counter()
        st = State(prob)
        before = self.model.evaluate(st)
        fixed = Counter(r for r in prob.fixed_reason if r)
        search = None
        if prob.cand is not None and prob.movable.any() and self.cfg.max_moves_per_round > 0:
            search = self._search(prob, st)
            st = search.st
        after = self.model.evaluate(st)
        moves = self._moves(search) if search else []
        H = self.cfg.amortization_seconds
        mig = sum(m.migration_cost for m in moves)
        return Plan(
            moves=moves,
            cost_before=CostSummary(total=sum(before.values()), terms=before),
            cost_after=CostSummary(total=sum(after.values()), terms=after),
            migration_cost=mig, amortization_seconds=H,
            objective_before=H * sum(before.values()), objective_after=H * sum(after.values()) + mig,
            containers=prob.n, movable=int(prob.movable.sum()), fixed=dict(sorted(fixed.items())),
            missing_signals=sorted(missing_signals or []), notes=list(prob.notes),
            duration_seconds=time.perf_counter() - t0,
        )

    # -- search --------------------------------------------------------------------------------------
    def _beam_width(self, prob: Problem) -> int:
        """Plain greedy on big problems; a small beam where a round is cheap. Work-based, not
        time-based, so the plan stays deterministic."""
        work = max(1, int(prob.movable.sum()) * prob.cands.n)
        return int(max(1, min(BEAM_MAX, BEAM_WORK // work)))

    def _root(self, prob: Problem, st: State) -> _Search:
        """The search before any move: migration costs and valid destinations of the movable rows."""
        mov = np.flatnonzero(prob.movable)
        mig = self.model.migration.matrix(prob, mov)
        valid = prob.valid(mov)
        home = prob.current[mov]
        has_home = np.flatnonzero(home >= 0)
        # Going back to where it was costs nothing; it is offered only to a container moved this round.
        mig[has_home, home[has_home]] = 0.0
        min_mig = np.where(valid, mig, np.inf).min(axis=1)
        root = _Search(prob, st, mov, mig, valid, min_mig, np.full(len(mov), -1))
        if len(mov) * prob.cands.n > LAZY_WORK:
            # The bounds are taken once: a step changes the state near two places, and a row whose
            # best move it improved is one whose hint is stale either way.
            root.hint = self._bound(root, np.arange(len(mov)))
        return root

    def _search(self, prob: Problem, st: State) -> _Search:
        root = self._root(prob, st)
        limit = self.cfg.max_moves_per_round
        best = self._descend(root, limit)
        if self._small(prob):
            # Multi-start: the greedy's first choice fixes much of what follows (which package the
            # AVX512 work goes to, which node a hog leaves for); on small problems descend again from
            # each of the best first moves, paying or not, and keep the best plan.
            for first in self._top_singles(root, self._allowed(root, limit), -np.inf, MULTI_START + 1):
                if best.steps and (first.row, first.cand) == (best.steps[0].row, best.steps[0].cand):
                    continue
                start = root.clone()
                self._apply(start, first)
                other = self._descend(start, limit, pairs_every_step=False)
                # The forced first move need not pay by itself; the plan must, by min_net_gain a step.
                if other.value > best.value + 1e-12 and other.value > self.cfg.min_net_gain * len(other.steps):
                    best = other
            best = self._chains(best, limit)
            best = self._kicks(best, limit)
        return best

    def _kicks(self, s: _Search, limit: int) -> _Search:
        """Small problems: group relocations followed by a descent of single moves (a perturbation, in
        the sense of iterated local search).

        Containers that share a place move together onto a plateau or over a ridge that no short move
        sequence crosses: on avx512-mix the greedy fences the AVX-512 work into the package of one of the
        two latency-critical containers, and the optimum (both latency-critical containers on one
        high-priority core, the AVX-512 work in the other package, ten containers placed differently) is
        reached by moving the five scalar containers sharing package 0 onto one NUMA node (no change of
        ``J``), then single moves. Every group of ≥ 2 movable containers on one candidate (at most
        ``KICK_GROUPS``, largest first) is tried at every other candidate the budget allows; the best
        result replaces the plan when it gains more than ``min_net_gain`` (and the plan still pays
        ``min_net_gain`` a step, as after a multi-start), then local improvement runs again. At most
        ``KICK_ROUNDS`` rounds."""
        for _ in range(KICK_ROUNDS):
            at = np.where(s.placed >= 0, s.placed, s.prob.current[s.mov])
            groups = [np.flatnonzero(at == c) for c in np.unique(at[at >= 0])]
            groups = sorted((g for g in groups if len(g) >= 2), key=lambda g: (-len(g), int(g[0])))[:KICK_GROUPS]
            found: _Search | None = None
            moved = s.placed >= 0
            for g in groups:
                home = s.prob.current[s.mov[g]]
                for c in range(s.prob.cands.n):
                    if c == at[g[0]] or not np.all((home == c) | s.valid[g, c]):
                        continue
                    if int(moved.sum()) - int(moved[g].sum()) + int((home != c).sum()) > limit:
                        continue
                    k = s.clone()
                    for r in g.tolist():
                        self._apply(k, self._forced(k, r, c))
                    self._singles(k, limit)
                    best = s if found is None else found
                    if k.value > best.value + self.cfg.min_net_gain and k.value > self.cfg.min_net_gain * len(k.steps):
                        found = k
            if found is None:
                break
            s = self._chains(self._improve(found, limit), limit)
        return s

    def _forced(self, s: _Search, k: int, c: int) -> _Step:
        """Row ``k`` to candidate ``c`` (or home) whatever it scores, as a step with its score and parts."""
        H, m = self.cfg.amortization_seconds, self.cfg.gain_margin
        i = int(s.mov[k])
        before = self.model.evaluate(s.st)
        was = float(self._mcur(s, np.array([k]))[0])
        snap, placed = s.st.snapshot(i), int(s.placed[k])
        self._place(s, k, c)
        after = self.model.evaluate(s.st)
        now = float(self._mcur(s, np.array([k]))[0])
        s.st.restore(snap)
        s.placed[k] = placed
        parts = {n: after[n] - before[n] for n in before}
        return _Step(k, c, -H * sum(parts.values()) - (1.0 + m) * (now - was), parts)

    def _singles(self, s: _Search, limit: int) -> None:
        """Best single moves (above ``min_net_gain``) until none is left."""
        for _ in range(4 * limit + 8):
            step = self._best_single(s, self._allowed(s, limit), self.cfg.min_net_gain)
            if step is None:
                return
            self._apply(s, step)

    def _chains(self, s: _Search, limit: int) -> _Search:
        """Small problems: three-move chains, then local improvement again.

        A replacement frees one move, but the container that should take it may pay only once a moved
        one makes room (fragmented-pools: A goes home, B moves within its node, C takes B's place) or a
        moved one goes elsewhere too (bandwidth-hogs: a hog goes home, another hog's destination and a
        third hog's move change together); no single move or pair on the way pays. Each moved container
        is sent home in turn and the best pair is searched after it (see :meth:`_best_pair`); the chain
        is taken when the three moves together gain more than ``min_net_gain``. At most ``limit + 4``
        chains a round: each lowers ``J``, and the work stays a few pair searches per moved container."""
        for _ in range(limit + 4):
            chain = self._best_chain(s, limit)
            if chain is None:
                break
            for step in chain:
                self._apply(s, step)
            s = self._improve(s, limit)
        return s

    def _best_chain(self, s: _Search, limit: int) -> list[_Step] | None:
        """The best (home, pair) chain from ``s`` gaining more than ``min_net_gain``, or None."""
        H, m = self.cfg.amortization_seconds, self.cfg.gain_margin
        before = self.model.evaluate(s.st)
        best: list[_Step] | None = None
        best_value = self.cfg.min_net_gain
        for a in np.flatnonzero(s.placed >= 0).tolist():
            i = int(s.mov[a])
            snap, placed = s.st.snapshot(i), int(s.placed[a])
            freed = float(s.mig[a, placed])
            home = int(s.prob.current[i])
            self._place(s, a, home)
            after = self.model.evaluate(s.st)
            parts = {n: after[n] - before[n] for n in before}
            v0 = -H * sum(parts.values()) + (1.0 + m) * freed
            ks = self._allowed(s, limit)
            ks = ks[ks != a]
            seen: dict[int, float] = {}
            self._top_singles(s, ks, -np.inf, 1, seen)
            pair = self._best_pair(s, ks, limit, seen, floor=best_value - v0) if len(ks) else None
            s.st.restore(snap)
            s.placed[a] = placed
            if pair is not None and v0 + pair[0].score + pair[1].score > best_value:
                best_value = v0 + pair[0].score + pair[1].score
                best = [_Step(a, home, v0, parts, enables=pair[0].row), pair[0], pair[1]]
        return best

    def _descend(self, root: _Search, limit: int, pairs_every_step: bool = True) -> _Search:
        """Beam search over single and pair moves from ``root``, then local improvement."""
        prob = root.prob
        width = self._beam_width(prob)
        small = self._small(prob)
        pairs_every_step = pairs_every_step and small
        beam, best = [root], root
        for _ in range(4 * limit + 8):
            children: list[_Search] = []
            for b in beam:
                allowed = self._allowed(b, limit)
                if len(allowed) == 0:
                    continue
                seen: dict[int, float] = {}
                steps = self._top_singles(b, allowed, self.cfg.min_net_gain, width, seen)
                for step in steps:
                    c = b if width == 1 and not small else b.clone()
                    self._apply(c, step)
                    children.append(c)
                # Best improvement over singles and pairs: a pair is looked for on every step of a
                # small problem, and on a large one when no single move pays. It is taken when it
                # beats the best single followed by the best move after it (both use two moves).
                if steps and not pairs_every_step:
                    continue
                pair = self._best_pair(b, allowed, limit, seen)
                if pair is None:
                    continue
                if steps:
                    two = children[-len(steps)]
                    follow = self._best_single(two, self._allowed(two, limit), self.cfg.min_net_gain)
                    if pair[0].score + pair[1].score <= steps[0].score + (follow.score if follow else 0.0):
                        continue
                c = b.clone()
                self._apply(c, pair[0])
                self._apply(c, pair[1])
                children.append(c)
            if not children:
                break
            beam = self._select(children, width)
            if beam[0].value > best.value:
                best = beam[0]
        return self._improve(best.clone() if best is root else best, limit)

    @staticmethod
    def _select(children: list[_Search], width: int) -> list[_Search]:
        uniq: dict[bytes, _Search] = {}
        for c in children:
            key = c.placed.tobytes()
            if key not in uniq or c.value > uniq[key].value:
                uniq[key] = c
        return sorted(uniq.values(), key=lambda c: (-c.value, c.placed.tobytes()))[:width]

    def _improve(self, s: _Search, limit: int) -> _Search:
        """Local search from the best plan found: with the move budget spent, the steps left are a moved
        container going elsewhere or home, and *replacements* — one moved container goes home and
        another moves instead (a pair whose first move frees the budget its second uses). Each accepted
        step lowers ``J``; the loop ends when none does."""
        for _ in range(2 * limit + 4):
            allowed = self._allowed(s, limit)
            if len(allowed) == 0:
                break
            seen: dict[int, float] = {}
            step = self._top_singles(s, allowed, self.cfg.min_net_gain, 1, seen)
            if step:
                self._apply(s, step[0])
                continue
            pair = self._best_pair(s, allowed, limit, seen, replacements=True)
            if pair is None:
                break
            self._apply(s, pair[0])
            self._apply(s, pair[1])
        return s

    def _moved(self, s: _Search) -> np.ndarray:
        return s.placed >= 0

    def _allowed(self, s: _Search, limit: int) -> np.ndarray:
        moved = self._moved(s)
        if moved.sum() >= limit:
            return np.flatnonzero(moved)
        return np.arange(len(s.mov))

    def _mcur(self, s: _Search, ks: np.ndarray) -> np.ndarray:
        p = s.placed[ks]
        out = np.zeros(len(ks))
        m = p >= 0
        out[m] = s.mig[ks[m], p[m]]
        return out

    def _valid(self, s: _Search, ks: np.ndarray) -> np.ndarray:
        v = s.valid[ks].copy()
        home = s.prob.current[s.mov[ks]]
        moved = s.placed[ks] >= 0
        back = np.flatnonzero(moved & (home >= 0))
        v[back, home[back]] = True  # may return home
        here = np.flatnonzero(moved)
        v[here, s.placed[ks[here]]] = False  # not a move
        return v

    def _scores(self, s: _Search, ks: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        H, m = self.cfg.amortization_seconds, self.cfg.gain_margin
        total, parts = self.model.delta(s.st, s.mov[ks])
        score = -H * total - (1.0 + m) * (s.mig[ks] - self._mcur(s, ks)[:, None])
        score[~self._valid(s, ks)] = -np.inf
        return score, parts

    def _bound(self, s: _Search, ks: np.ndarray) -> np.ndarray:
        """Per row of ``ks``, an upper bound of its best score (from each term's ``min_delta``)."""
        H, m = self.cfg.amortization_seconds, self.cfg.gain_margin
        lb = np.zeros(len(ks))
        for t in self.model.active_terms(s.prob):
            lb += t.min_delta(s.prob, s.st, s.mov[ks])
        min_mig = np.where(s.placed[ks] >= 0, 0.0, s.min_mig[ks])  # a moved row may go home for free
        return -H * lb - (1.0 + m) * (min_mig - self._mcur(s, ks))

    def _top_singles(self, s: _Search, ks: np.ndarray, floor: float, count: int,
                     seen: dict[int, float] | None = None) -> list[_Step]:
        """The ``count`` best single moves among rows ``ks`` (indices into ``s.mov``) scoring above
        ``floor``, best first.

        Rows are scanned in the order of an upper bound of their score and the scan stops when no
        remaining row can enter the result. ``seen`` receives the best score of every row evaluated;
        when it is asked for, at least the first chunk is evaluated."""
        if s.hint is not None:
            ub = s.hint[ks]
        elif len(ks) <= CHUNK:
            ub = np.full(len(ks), np.inf)  # one chunk: evaluated whole, no bound needed
        else:
            ub = self._bound(s, ks)
        order = np.argsort(-ub, kind="stable")
        top: list[_Step] = []

        def bar() -> float:
            return max(floor, top[-1].score) if len(top) >= count else floor

        # Lazy: the first chunk is small (the rows whose hint is highest, mostly since the last step),
        # the next ones full (a scan that goes on is one through stale hints or bounds).
        first = LAZY_CHUNK if s.hint is not None else CHUNK
        starts = [0, *range(first, len(order), CHUNK)] if len(order) else []
        for lo, hi in zip(starts, [*starts[1:], len(order)], strict=False):
            chunk = order[lo:hi]
            if ub[chunk[0]] <= bar() and not (seen is not None and lo == 0):
                break
            kk = ks[chunk]
            score, parts = self._scores(s, kk)
            if s.hint is not None:
                s.hint[kk] = score.max(axis=1)
            if seen is not None:
                for k, v in zip(kk, score.max(axis=1), strict=True):
                    seen[int(k)] = float(v)
            flat = score.ravel()
            picks = [int(np.argmax(flat))] if count == 1 else np.argsort(-flat, kind="stable")[:count].tolist()
            for f in picks:
                r, c = divmod(f, score.shape[1])
                v = float(score[r, c])
                if not np.isfinite(v) or v <= bar():
                    continue
                top.append(_Step(int(kk[r]), c, v, {n: float(a[r, c]) for n, a in parts.items()}))
                top.sort(key=lambda t: -t.score)
                del top[count:]
        return top

    def _best_single(self, s: _Search, ks: np.ndarray, floor: float) -> _Step | None:
        top = self._top_singles(s, ks, floor, 1)
        return top[0] if top else None

    def _first_moves(self, s: _Search, ks: np.ndarray, seen: dict[int, float]) -> list[int]:
        """Rows worth trying as the first of two moves: the strongest bilinear pairs (no single move of
        theirs pays, see the module doc), rows moved already (early greedy choices are the myopic
        ones), then the rows whose best single move came closest to paying."""
        out: list[int] = []
        rows = s.mov[ks]
        P = None
        for t in self.model.active_terms(s.prob):
            p = t.pairs(s.prob, s.st, rows)
            if p is not None:
                P = p if P is None else P + p
        if P is not None and len(ks) > 1:
            P = P + P.T
            np.fill_diagonal(P, 0.0)
            flat = np.triu(P, 1).ravel()
            top = np.argpartition(-flat, PAIRS)[:PAIRS] if flat.size > PAIRS else np.arange(flat.size)
            top = top[np.lexsort((top, -flat[top]))]  # by value, ties by position: deterministic
            for t in top:
                if flat[t] <= 0:
                    break
                a, b = divmod(int(t), len(ks))
                out += [int(ks[a]), int(ks[b])]
        out += [int(k) for k in ks if s.placed[k] >= 0]
        out += [k for k, _ in sorted(seen.items(), key=lambda kv: (-kv[1], kv[0]))]
        if self._small(s.prob):
            out += [int(k) for k in ks]  # cheap enough to try every row
            return list(dict.fromkeys(out))
        return list(dict.fromkeys(out))[:FIRST_MOVES]

    def _small(self, prob: Problem) -> bool:
        """Small: a pair search over every row is cheap (each first move is followed by a scan of
        every row over every candidate), so pairs are looked for at every step, from several starts."""
        k = int(prob.movable.sum())
        return k <= SMALL_ROWS and k * k * prob.cands.n <= PAIR_WORK

    def _best_pair(self, s: _Search, ks: np.ndarray, limit: int, seen: dict[int, float],
                   replacements: bool = False, floor: float | None = None) -> tuple[_Step, _Step] | None:
        """Two consecutive moves that together gain the most (above ``floor``, default ``min_net_gain``).

        First moves: on small problems every (row, destination); on large ones the rows of
        :meth:`_first_moves`, each with its ``PAIR_FIRST`` best destinations (so no row uses up the
        trials of the others). With the budget spent, first moves are those of moved rows — home
        (freeing the budget for another container: a replacement) or elsewhere."""
        free = limit - int(self._moved(s).sum())
        best: tuple[_Step, _Step] | None = None
        small = self._small(s.prob)
        firsts = self._first_moves(s, ks, seen)
        if replacements or free < 1:
            firsts = [k for k in firsts if s.placed[k] >= 0] + ([k for k in firsts if s.placed[k] < 0] if free else [])
        home_only = replacements and not small
        if home_only:
            # Large problems: replace the weakest moves only — each goes home, its move goes elsewhere.
            worth: dict[int, float] = {}
            for step in s.steps:
                worth[step.row] = worth.get(step.row, 0.0) + step.score
            firsts = sorted((k for k in firsts if s.prob.current[s.mov[k]] >= 0), key=lambda k: (worth.get(k, 0.0), k))
            firsts = firsts[:REPLACE_TRIALS]
        if not firsts:
            return None
        sc, parts = self._scores(s, np.array(firsts))
        dests = PAIR_FIRST_SMALL if small else PAIR_FIRST
        for r, first in enumerate(firsts):
            # Destinations of distinct scores: interchangeable candidates (the cores of one idle NUMA
            # node) score the same, and trying each would spend the trials on one idea.
            order = np.argsort(-sc[r], kind="stable")
            v = np.where(np.isfinite(sc[r][order]), sc[r][order], -1e300)  # invalid ones sort last
            uniq = np.r_[True, np.abs(np.diff(v)) > 1e-9 * (1.0 + np.abs(v[1:]))]
            order = order[uniq[: len(order)]][:dests] if len(order) else order
            if home_only:
                order = np.array([s.prob.current[s.mov[first]]])
            for c1 in order:
                v1 = float(sc[r, c1])
                if not np.isfinite(v1):
                    break
                step1 = _Step(first, int(c1), v1, {n: float(v[r, c1]) for n, v in parts.items()})
                snap, placed = s.st.snapshot(int(s.mov[first])), int(s.placed[first])
                self._place(s, first, int(c1))
                rest = self._allowed(s, limit)
                rest = rest[rest != first]
                need = (self.cfg.min_net_gain if floor is None else floor) - v1
                if best is not None:
                    need = max(need, best[0].score + best[1].score - v1)
                step2 = self._best_single(s, rest, need) if len(rest) else None
                s.st.restore(snap)
                s.placed[first] = placed
                if step2 is not None:
                    step1.enables = step2.row
                    best = (step1, step2)
        return best

    def _place(self, s: _Search, k: int, c: int) -> None:
        i = s.mov[k]
        home = s.prob.current[i]
        if s.hint is not None:
            s.hint[k] = np.inf
        if c == home:
            s.st.set_row(i, s.prob.S0[i].copy())
            s.placed[k] = -1
        else:
            s.st.set_row(i, s.prob.cands.row(c))
            s.placed[k] = c

    def _apply(self, s: _Search, step: _Step) -> None:
        self._place(s, step.row, step.cand)
        s.steps.append(step)
        s.value += step.score

    # -- output --------------------------------------------------------------------------------------
    def _moves(self, s: _Search) -> list[MoveModel]:
        prob, H = s.prob, self.cfg.amortization_seconds
        summaries = {t.name: t.summary for t in self.model.terms}
        parts_of: dict[int, dict[str, float]] = {}
        enables: dict[int, int] = {}
        for st_ in s.steps:
            acc = parts_of.setdefault(st_.row, {})
            for n, v in st_.parts.items():
                acc[n] = acc.get(n, 0.0) + v
            if st_.enables is not None:
                enables[st_.row] = st_.enables

        def why(k: int) -> str:
            better = sorted((v, n) for n, v in parts_of.get(k, {}).items() if v < -1e-12)
            return "; ".join(f"{summaries.get(n, n)} ({v:+.3g}/s)" for v, n in better)

        moved = [int(s.mov[k]) for k in np.flatnonzero(s.placed >= 0)]
        pairs = separations(prob, self.model, s.st.S, moved)
        out = []
        for k in np.flatnonzero(s.placed >= 0):
            i = int(s.mov[k])
            c = int(s.placed[k])
            parts = parts_of.get(int(k), {})
            gain = -sum(parts.values())
            reason = why(int(k))
            if not reason and int(k) in enables:
                other = prob.containers[int(s.mov[enables[int(k)]])]
                reason = f"makes room for {other.name or other.id}: {why(enables[int(k)]) or 'a better placement'}"
            pos = prob.cands.positions(c)
            mb = self.model.migration.single(prob, i, prob.S0[i], prob.cands.row(c))
            ci = prob.containers[i]
            out.append(MoveModel(
                container_id=ci.id, name=ci.name, namespace=ci.namespace, pod=ci.pod,
                from_cpus=format_cpulist(ci.cpuset), to_cpus=format_cpulist(prob.node.cpus_of(pos)),
                to_mems=format_cpulist(prob.node.mems_of(pos)), destination=prob.cands.labels[c],
                reason=reason or "rebalances load", reasons={n: round(v, 12) for n, v in sorted(parts.items())},
                gain_by_term={n: round(-v * H, 9) for n, v in sorted(parts.items()) if abs(v) > 1e-12},
                separates=pairs[i], gain_per_second=gain, predicted_gain=gain * H, migration_cost=mb.total,
                migration=MigrationModel(disruption=mb.disruption, rewarm=mb.rewarm, remote_memory=mb.remote_memory),
            ))
        return sorted(out, key=lambda m: m.container_id)
