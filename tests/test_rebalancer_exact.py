"""The exact MILP: the fixed containers' cost kept whatever HiGHS answers, symmetry rows that keep the optimum,
the planner's own objective (with its hysteresis), and the search's gap to the optimum per family under a
binding move budget (fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from cri_resmgr.config import RebalancerConfig
from cri_resmgr.rebalancer.model import CostModel
from cri_resmgr.rebalancer.planner import Planner
from cri_resmgr.rebalancer.problem import Problem, State
from cri_resmgr.rebalancer.simulator import FAMILIES, generate
from cri_resmgr.topology.fixtures import MachineSpec

pytest.importorskip("highspy", reason="the exact solver needs highspy (pip install '.[test]')")

from cri_resmgr.rebalancer.exact import Encoder, objective_of, optimum

SMALL = MachineSpec("test-2s-4c-snc2", packages=2, dies_per_package=1, cores_per_die=4, threads_per_core=2,
                    numa_per_package=2, l3_per_die=1, l3_kib_per_domain=16384, base_frequency_khz=2000000,
                    base_frequency_overrides_khz={c: 2600000 for c in (0, 4, 8, 12)})


def problem_of(family: str, n: int, seed: int, budget: int, **over) -> Problem:
    sc = generate(family, SMALL, n, seed=seed, numa_bandwidth_bytes_per_second=20e9,
                  rebalancer={"max_moves_per_round": budget, **over})
    cfg = sc.config()
    return Problem.build(sc.node_model(cfg), sc.inputs(), cfg, now=0.0)


def test_nothing_movable_still_costs_what_the_fixed_containers_cost():
    prob = problem_of("mixed", 12, 0, 4, namespaces=["elsewhere"])  # nothing selected: nothing movable
    model = CostModel(prob.cfg)
    assert not prob.movable.any()
    fixed = prob.cfg.amortization_seconds * model.total(State(prob))
    assert fixed > 100  # a real cost (oversubscribed fragmented pools, bandwidth hogs), not a zero
    ex = optimum(prob, model, time_limit_seconds=30)
    assert ex.status == "Optimal" and not ex.choice
    assert ex.objective == pytest.approx(fixed, rel=1e-9)


def test_optimum_includes_the_fixed_cost_when_some_containers_move():
    prob = problem_of("bandwidth-hogs", 8, 1, 2)
    model = CostModel(prob.cfg)
    ex = optimum(prob, model, time_limit_seconds=60)
    assert ex.status == "Optimal"
    assert ex.objective == pytest.approx(objective_of(prob, model, ex.rows, ex.choice), rel=1e-6)


def test_symmetry_rows_keep_the_optimum():
    prob = problem_of("avx512-mix", 8, 2, 8)
    model = CostModel(prob.cfg)
    plain = Encoder(prob, model, symmetry=False).solve(60)
    enc = Encoder(prob, model)
    broken = enc.solve(60)
    assert enc.symmetry_rows > 0  # every container starts on the whole pool: most cores are interchangeable
    assert plain.status == broken.status == "Optimal"
    assert broken.objective == pytest.approx(plain.objective, rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_search_is_within_five_percent_of_the_optimum_under_a_binding_budget(family):
    """The planner's own objective (migration × (1 + gain_margin)) against the MILP of the same objective,
    with fewer moves allowed than would pay: the budget binds."""
    prob = problem_of(family, 12, 0, 4)
    model = CostModel(prob.cfg)
    plan = Planner(prob.cfg, model).plan(prob)
    factor = 1.0 + prob.cfg.gain_margin
    index = {c.id: i for i, c in enumerate(prob.containers)}
    rows, choice = prob.S0.copy(), {}
    for m in plan.moves:
        i = index[m.container_id]
        c = prob.cands.index_of(prob.node.positions(frozenset(int(x) for x in _cpus(m.to_cpus))))
        rows[i], choice[i] = prob.cands.row(c), c
    j_plan = objective_of(prob, model, rows, choice, factor)
    ex = optimum(prob, model, time_limit_seconds=60, migration_factor=factor)
    assert ex.status == "Optimal"
    assert j_plan <= ex.objective * 1.05 + 1e-6, (family, j_plan, ex.objective)
    assert len(plan.moves) <= prob.cfg.max_moves_per_round


def test_a_swap_that_starts_with_a_batch_container_is_found_under_a_budget():
    """SST-BF: a latency-critical container off the high-priority cores, batch work on them. The swap needs
    the batch container to leave first; with two moves allowed both must go to the swap."""
    from cri_resmgr.rebalancer.problem import ANNOTATION_LATENCY_CRITICAL, ContainerInput, NodeModel
    from cri_resmgr.rebalancer.scenario import topology_from_spec

    node = NodeModel.from_topology(topology_from_spec(SMALL))
    cfg = RebalancerConfig(max_moves_per_round=2)
    cs = [ContainerInput(id="batch", cpuset=frozenset({0, 8}), cpu_usage=2.0, cpu_request=2.0),
          ContainerInput(id="web", cpuset=frozenset({1, 9}), cpu_usage=2.0, cpu_request=2.0,
                         annotations={ANNOTATION_LATENCY_CRITICAL: "true"})]
    cs += [ContainerInput(id=f"fill{k}", cpuset=frozenset({c, c + 8}), cpu_usage=2.0, cpu_request=2.0)
           for k, c in enumerate((2, 3, 4, 5, 6, 7))]
    prob = Problem.build(node, cs, cfg)
    model = CostModel(cfg)
    plan = Planner(cfg, model).plan(prob)
    moved = {m.container_id: m.to_cpus for m in plan.moves}
    ex = optimum(prob, model, time_limit_seconds=60, migration_factor=1.0 + cfg.gain_margin)
    assert ex.status == "Optimal" and len(ex.choice) == 2
    assert moved.get("web") in ("0,8", "4,12"), plan.moves
    assert plan.cost_after.terms["latency_critical"] == 0.0


def _cpus(text: str) -> list[int]:
    from cri_resmgr.sysfs import parse_cpulist

    return sorted(parse_cpulist(text))


def test_the_planners_placement_starts_the_solver_at_its_own_cost():
    """A MIP start: every column derived from the planner's placement has the model's cost of that placement,
    and the solver's answer is never worse than it."""
    prob = problem_of("mixed", 12, 1, 4)
    model = CostModel(prob.cfg)
    factor = 1.0 + prob.cfg.gain_margin
    plan = Planner(prob.cfg, model).plan(prob)
    index = {c.id: i for i, c in enumerate(prob.containers)}
    rows, choice = prob.S0.copy(), {}
    for m in plan.moves:
        i = index[m.container_id]
        c = prob.cands.index_of(prob.node.positions(frozenset(_cpus(m.to_cpus))))
        rows[i], choice[i] = prob.cands.row(c), c
    enc = Encoder(prob, model, factor)
    for t in model.active_terms(prob):
        t.encode(enc)
    start = enc.start_values(choice)
    j_plan = objective_of(prob, model, rows, choice, factor)
    assert enc.constant + float(np.asarray(enc.cost) @ start) == pytest.approx(j_plan, rel=1e-9)
    ex = Encoder(prob, model, factor).solve(60, start=choice)
    assert ex.status == "Optimal" and ex.objective <= j_plan + 1e-6


@pytest.mark.parametrize("family,n,seed,budget", [("avx512-mix", 10, 0, 3), ("avx512-mix", 8, 2, 8),
                                                   ("mixed", 10, 1, 4), ("avx512-mix", 12, 0, 2)])
def test_products_around_the_current_placement_keep_the_optimum(family, n, seed, budget):
    """The AVX-512 products written as moves from the current placement (tight LP, budget-bounded McCormick)
    reach the optimum of the first encoding (McCormick on the whole product, no symmetry rows)."""
    prob = problem_of(family, n, seed, budget)
    model = CostModel(prob.cfg)
    plain = Encoder(prob, model, symmetry=False, products="plain").solve(60)
    delta = Encoder(prob, model).solve(60)
    assert plain.status == delta.status == "Optimal"
    assert delta.objective == pytest.approx(plain.objective, rel=1e-6, abs=1e-6)
    assert delta.objective == pytest.approx(objective_of(prob, model, delta.rows, delta.choice), rel=1e-6)


def _violations(enc: Encoder, col: np.ndarray) -> list[int]:
    bad = []
    for r, (idx, vals, lo, hi) in enumerate(enc.constraints):
        v = float(vals @ col[idx])
        if v < lo - 1e-7 * (1 + abs(lo)) or v > hi + 1e-7 * (1 + abs(hi)):
            bad.append(r)
    return bad


def test_a_start_is_brought_into_first_occupant_order_at_the_same_cost():
    """Every container on the whole pool: moving the first two of them to the last cores of a NUMA node breaks the
    symmetry rows (the first occupant must take the first of interchangeable siblings); the canonical form of the
    same placement satisfies every row and costs the same."""
    prob = problem_of("avx512-mix", 8, 2, 8)
    model = CostModel(prob.cfg)
    enc = Encoder(prob, model)
    for t in model.active_terms(prob):
        t.encode(enc)
    assert enc.symmetry_rows > 0
    cand = prob.cands
    cores = [c for c in range(cand.n) if cand.size[c] == 2 and prob.need[0] <= 2 and prob.need[1] <= 2]
    choice = {0: cores[-1], 1: cores[-2]}
    assert _violations(enc, enc.start_values(choice))  # not in first-occupant order
    canon = enc.canonical(choice)
    assert canon != choice
    col = enc.start_values(canon)
    assert _violations(enc, col) == []
    rows = prob.S0.copy()
    for i, c in choice.items():
        rows[i] = cand.row(c)
    crow = prob.S0.copy()
    for i, c in canon.items():
        crow[i] = cand.row(c)
    j = objective_of(prob, model, rows, choice)
    assert objective_of(prob, model, crow, canon) == pytest.approx(j, rel=1e-9)
    assert enc.constant + float(np.asarray(enc.cost) @ col) == pytest.approx(j, rel=1e-9)


# -- the queueing bandwidth term: MILP against brute force on tiny cases --------------------------------
def _tiny_bandwidth_problem(seed: int, budget: int) -> Problem:
    from cri_resmgr.rebalancer.problem import ContainerInput, NodeModel
    from cri_resmgr.rebalancer.scenario import ScenarioCpu, topology_from_cpus

    # 2 NUMA nodes × 2 cores, one L3 per node, 10 GB/s per node: offered loads between 0 and ~3
    # capacities cross every segment of the curve.
    cpus = [ScenarioCpu(id=i, core=i, package=0, numa_node=i // 2, l3=i // 2, base_frequency_hz=2e9) for i in range(4)]
    node = NodeModel.from_topology(topology_from_cpus(cpus, 32 * 2**20, None), numa_bandwidth=10e9)
    rng = np.random.default_rng(seed)
    inputs = [ContainerInput(id=f"c{k}", cpuset=frozenset({int(rng.integers(0, 2))}), cpu_usage=0.5,
                             cpu_request=0.0, qos="Burstable",
                             memory_bandwidth_bytes_per_second=float(rng.uniform(1, 12)) * 1e9)
              for k in range(4)]
    cfg = RebalancerConfig.model_validate({"max_moves_per_round": budget})
    return Problem.build(node, inputs, cfg, now=0.0)


def _brute_force(prob: Problem, model: CostModel) -> float:
    import itertools

    mov = np.flatnonzero(prob.movable)
    valid = prob.valid(mov)
    options = [[-1, *np.flatnonzero(valid[k]).tolist()] for k in range(len(mov))]
    best = np.inf
    for combo in itertools.product(*options):
        choice = {int(i): int(c) for i, c in zip(mov, combo, strict=True) if c >= 0}
        if len(choice) > prob.cfg.max_moves_per_round:
            continue
        rows = prob.S0.copy()
        for i, c in choice.items():
            rows[i] = prob.cands.rows[c]
        best = min(best, objective_of(prob, model, rows, choice))
    return best


@pytest.mark.parametrize("seed,budget", [(0, 4), (1, 2), (2, 1), (3, 4)])
def test_queueing_bandwidth_term_milp_equals_brute_force(seed, budget):
    prob = _tiny_bandwidth_problem(seed, budget)
    cfg = prob.cfg
    model = CostModel(cfg)
    assert "memory_bandwidth" in [t.name for t in model.active_terms(prob)]
    ex = optimum(prob, model, time_limit_seconds=60)
    assert ex.status == "Optimal"
    assert ex.objective == pytest.approx(objective_of(prob, model, ex.rows, ex.choice), rel=1e-6, abs=1e-6)
    assert ex.objective == pytest.approx(_brute_force(prob, model), rel=1e-6, abs=1e-6)


def test_queueing_bandwidth_start_values_lie_on_the_curve():
    """A MIP start values each bandwidth variable at its largest segment: the start's objective is the
    model's cost of the placement (the segments below the curve do not bind)."""
    prob = _tiny_bandwidth_problem(0, 4)
    model = CostModel(prob.cfg)
    enc = Encoder(prob, model)
    for t in model.active_terms(prob):
        t.encode(enc)
    col = enc.start_values({})
    assert enc.constant + float(np.array(enc.cost) @ col) == pytest.approx(
        objective_of(prob, model, prob.S0, {}), rel=1e-9)
