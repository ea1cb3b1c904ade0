"""The rebalancer's cost model: each term against hand-computed values, migration cost, the vectorised
deltas against re-evaluation, the bounds, the tree order and the fixture topologies."""

from __future__ import annotations

import numpy as np
import pytest

from cri_resmgr.config import RebalancerConfig
from cri_resmgr.rebalancer import bandwidth_curve as bwc
from cri_resmgr.rebalancer import terms
from cri_resmgr.rebalancer.model import CostModel
from cri_resmgr.rebalancer.problem import (
    ANNOTATION_AVX512,
    ANNOTATION_LATENCY_CRITICAL,
    ContainerInput,
    NodeModel,
    Problem,
    State,
)
from cri_resmgr.rebalancer.scenario import ScenarioCpu, topology_from_cpus, topology_from_spec
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MACHINES, build_sysfs

GB, MiB = 1e9, 2**20


def small_node(packages=1, numa_per_package=1, cores=2, threads=2, sst=False, numa_bw=10 * GB, l3_mib=32):
    """packages × cores × threads, CPU id = (pkg, core, thread) in order; core id = lowest CPU of the core."""
    cpus = []
    cid = 0
    for p in range(packages):
        for c in range(cores):
            first = cid
            for _t in range(threads):
                numa = p * numa_per_package + c * numa_per_package // cores
                freq = (2.6e9 if c == 0 else 2.0e9) if sst else 2.0e9
                cpus.append(ScenarioCpu(id=cid, core=first, package=p, numa_node=numa, l3=p, base_frequency_hz=freq))
                cid += 1
    topo = topology_from_cpus(cpus, l3_mib * MiB, None)
    return NodeModel.from_topology(topo, numa_bandwidth=numa_bw)


def cost(node, containers, **cfg):
    c = RebalancerConfig.model_validate(cfg)
    prob = Problem.build(node, containers, c)
    return CostModel(c).evaluate(State(prob))


def C(id, cpus, usage=1.0, **kw):
    return ContainerInput(id=id, cpuset=frozenset(cpus), cpu_usage=usage, qos=kw.pop("qos", "Burstable"), **kw)


# -- terms ---------------------------------------------------------------------------------------------
def test_avx512_core_term_is_avx_load_times_sensitive_load_per_core_over_threads():
    node = small_node()  # core 0 = CPUs 0,1; core 2 = CPUs 2,3
    shared = cost(node, [C("a", {0, 1}, avx512_ratio=0.9), C("s", {0, 1})])
    assert shared["avx512_core"] == pytest.approx(1.0 * 1.0 / 2)
    apart = cost(node, [C("a", {0, 1}, avx512_ratio=0.9), C("s", {2, 3})])
    assert apart["avx512_core"] == 0.0
    # Spread over both cores: A = L = 0.5 per core -> 2 × 0.25 / 2.
    spread = cost(node, [C("a", {0, 1, 2, 3}, avx512_ratio=0.9), C("s", {0, 1, 2, 3})])
    assert spread["avx512_core"] == pytest.approx(0.25)


def test_avx512_term_counts_hint_threshold_qos_sensitivity_and_latency_critical():
    node = small_node()
    below = cost(node, [C("a", {0, 1}, avx512_ratio=0.05), C("s", {0, 1})])
    assert below["avx512_core"] == 0.0  # under avx512_threshold (0.1): not AVX512 work
    hint = cost(node, [C("a", {0, 1}, annotations={ANNOTATION_AVX512: "true"}), C("s", {0, 1})])
    assert hint["avx512_core"] == pytest.approx(0.5)
    be = cost(node, [C("a", {0, 1}, avx512_ratio=1.0), C("s", {0, 1}, qos="BestEffort")])
    assert be["avx512_core"] == pytest.approx(0.5 * 0.5)  # besteffort_sensitivity
    lc = cost(node, [C("a", {0, 1}, avx512_ratio=1.0), C("s", {0, 1}, annotations={ANNOTATION_LATENCY_CRITICAL: "1"})])
    assert lc["avx512_core"] == pytest.approx(0.5 * 2.0)  # latency_critical_factor
    weighted = cost(node, [C("a", {0, 1}, avx512_ratio=1.0), C("s", {0, 1})], weights={"avx512_core": 3.0})
    assert weighted["avx512_core"] == pytest.approx(1.5)


def test_avx512_package_term_normalises_by_package_cpus():
    node = small_node(packages=2, cores=1, threads=2)  # package 0 = CPUs 0,1; package 1 = CPUs 2,3
    same = cost(node, [C("a", {0}, avx512_ratio=1.0), C("s", {1})])
    assert same["avx512_core"] == pytest.approx(1.0 * 1.0 / 2)  # sibling threads of one core
    assert same["avx512_package"] == pytest.approx(0.25 * 1.0 * 1.0 / 2)
    other = cost(node, [C("a", {0}, avx512_ratio=1.0), C("s", {2})])
    assert other["avx512_package"] == 0.0 and other["avx512_core"] == 0.0


def test_memory_bandwidth_term_is_queueing_loss_over_numa_capacity():
    node = small_node(packages=1, numa_per_package=2, cores=2, threads=1, numa_bw=10 * GB)  # node 0 = CPU 0
    one = cost(node, [C("h", {0}, memory_bandwidth_bytes_per_second=15 * GB)])
    # Offered 1.5 capacities on node 0 (a breakpoint: the chords meet the curve), nothing on node 1.
    assert one["memory_bandwidth"] == pytest.approx(4.0 * float(bwc.lost(1.5)))
    both = cost(node, [C("h", {0, 1}, memory_bandwidth_bytes_per_second=15 * GB)])
    # 7.5 GB/s per node fits, but a node at 75 % of its peak already queues (the hinge said 0).
    assert both["memory_bandwidth"] == pytest.approx(2 * 4.0 * float(bwc.QUEUEING(0.75)))
    assert 0 < both["memory_bandwidth"] < one["memory_bandwidth"]
    # Without MBM the LLC misses stand in: one 64-byte line per miss.
    misses = cost(node, [C("h", {0}, llc_misses_per_second=15 * GB / 64)])
    assert misses["memory_bandwidth"] == pytest.approx(one["memory_bandwidth"])


def test_memory_bandwidth_term_caps_l3_domains_when_configured():
    node = small_node(packages=2, cores=1, threads=1)
    node = NodeModel.from_topology(topology_from_cpus(
        [ScenarioCpu(id=0, core=0, package=0, l3=0), ScenarioCpu(id=1, core=1, package=0, l3=1)], 32 * MiB, None),
        numa_bandwidth=100 * GB, l3_bandwidth=4 * GB)
    c = cost(node, [C("h", {0}, memory_bandwidth_bytes_per_second=6 * GB)])
    assert c["memory_bandwidth"] == pytest.approx(4.0 * float(bwc.lost(1.5) + bwc.QUEUEING(0.06)))


def test_cache_occupancy_term_is_excess_over_threshold_of_l3_size():
    node = small_node(packages=2, cores=1, threads=1, l3_mib=32)  # one L3 per package
    two = cost(node, [C("t1", {0}, llc_occupancy_bytes=20 * MiB), C("t2", {0}, llc_occupancy_bytes=20 * MiB)])
    assert two["cache_occupancy"] == pytest.approx(2.0 * (40 - 0.9 * 32) / 32)
    apart = cost(node, [C("t1", {0}, llc_occupancy_bytes=20 * MiB), C("t2", {1}, llc_occupancy_bytes=20 * MiB)])
    assert apart["cache_occupancy"] == 0.0


def test_latency_critical_term_counts_demand_off_sst_bf_high_priority_cores():
    node = small_node(cores=2, threads=2, sst=True)  # core 0 (CPUs 0,1) has the higher base frequency
    assert node.has_sst_bf and node.high_priority.tolist() == [True, True, False, False]
    lc = {ANNOTATION_LATENCY_CRITICAL: "true"}
    off = cost(node, [C("l", {0, 1, 2, 3}, usage=1.0, cpu_request=2.0, annotations=lc)])
    assert off["latency_critical"] == pytest.approx(2.0 * 0.5)  # demand = max(usage, request)
    on = cost(node, [C("l", {0, 1}, usage=1.0, cpu_request=2.0, annotations=lc)])
    assert on["latency_critical"] == 0.0
    plain = cost(node, [C("l", {2, 3}, usage=1.0)])
    assert plain["latency_critical"] == 0.0  # not annotated
    no_sst = cost(small_node(sst=False), [C("l", {2, 3}, annotations=lc)])
    assert "latency_critical" not in no_sst  # inactive without SST-BF


def test_oversubscription_term_counts_demand_beyond_each_cpu():
    node = small_node(cores=2, threads=1)  # CPUs 0, 1
    c = cost(node, [C("a", {0, 1}, usage=1.5), C("b", {0, 1}, usage=1.5)])
    assert c["oversubscription"] == pytest.approx(2.0 * (0.5 + 0.5))
    req = cost(node, [C("a", {0, 1}, usage=0.2, cpu_request=1.5), C("b", {0, 1}, usage=1.5)])
    assert req["oversubscription"] == pytest.approx(2.0)  # the request counts
    ok = cost(node, [C("a", {0}, usage=1.0), C("b", {1}, usage=1.0)])
    assert ok["oversubscription"] == 0.0


# -- migration -----------------------------------------------------------------------------------------
def migration(node, c: ContainerInput, to: set[int], **cfg):
    cfg_ = RebalancerConfig.model_validate(cfg)
    prob = Problem.build(node, [c], cfg_)
    new = np.zeros(node.ncpu)
    pos = node.positions(to)
    new[pos] = 1.0 / len(pos)
    return CostModel(cfg_).migration.single(prob, 0, prob.S0[0], new)


def test_migration_rewarm_is_usage_times_occupancy_over_bandwidth_when_l3_changes():
    node = small_node(packages=2, cores=2, threads=1)  # L3 per package: CPUs 0,1 | 2,3
    c = C("x", {0}, usage=2.0, llc_occupancy_bytes=100e6, memory_bandwidth_bytes_per_second=1e9)
    m = migration(node, c, {2})
    assert m.disruption == 1.0
    assert m.rewarm == pytest.approx(2.0 * 100e6 / 1e9)
    assert migration(node, c, {1}).rewarm == 0.0  # same L3: nothing to re-warm
    slow = C("x", {0}, usage=2.0, llc_occupancy_bytes=100e6, memory_bandwidth_bytes_per_second=1e6)
    assert migration(node, slow, {2}).rewarm == pytest.approx(2.0 * 100e6 / 1e9)  # floor 1 GB/s
    assert migration(node, c, {0}).total == 0.0  # not a move


def test_migration_remote_memory_follows_numa_distance():
    node = small_node(packages=2, cores=1, threads=1)  # node 0 = CPU 0, node 1 = CPU 1, distance 21
    c = C("x", {0}, usage=1.0, memory_bandwidth_bytes_per_second=10e9)
    m = migration(node, c, {1})
    assert m.remote_memory == pytest.approx(0.1 * 10 * 30 * (21 / 10 - 1))
    half = migration(node, c, {0, 1})
    assert half.remote_memory == pytest.approx(m.remote_memory / 2)
    assert migration(node, c, {1}, migration={"remote_memory": 0}).remote_memory == 0.0


# -- deltas and bounds ----------------------------------------------------------------------------------
def random_problem(seed=1, n=40, machine="xeon-2s-112c-snc2"):
    node = NodeModel.from_topology(topology_from_spec(MACHINES[machine]), numa_bandwidth=50 * GB)
    rng = np.random.default_rng(seed)
    P = node.ncpu
    cs = []
    for i in range(n):
        k = rng.integers(0, 4)
        cpus = (range(P) if k == 0 else range(P // 4) if k == 1
                else rng.choice(P, size=int(rng.integers(1, 30)), replace=False).tolist())
        cs.append(ContainerInput(
            id=f"c{i:03d}", cpuset=frozenset(int(x) for x in cpus), cpu_usage=float(rng.uniform(0, 6)),
            cpu_request=float(rng.integers(0, 3)), qos=["Burstable", "BestEffort", "Guaranteed"][i % 3],
            avx512_ratio=float(rng.choice([0, 0.9])), memory_bandwidth_bytes_per_second=float(rng.uniform(0, 30e9)),
            llc_occupancy_bytes=float(rng.uniform(0, 60e6)), exclusive=False,
            annotations={ANNOTATION_LATENCY_CRITICAL: "true"} if i % 5 == 0 else {}))
    cfg = RebalancerConfig()
    return Problem.build(node, cs, cfg), CostModel(cfg), rng


def test_vectorised_deltas_equal_reevaluation_after_each_move():
    prob, cm, rng = random_problem()
    st = State(prob)
    base = cm.evaluate(st)
    assert set(base) == {"avx512_core", "avx512_package", "memory_bandwidth", "cache_occupancy",
                         "latency_critical", "oversubscription"}
    assert all(v > 0 for v in base.values())  # every term is exercised
    rows = np.arange(prob.n)
    _, parts = cm.delta(st, rows)
    for k in rng.choice(prob.n, 12, replace=False):
        for c in rng.choice(prob.cands.n, 12, replace=False):
            s2 = st.copy()
            s2.set_row(k, prob.cands.row(c))
            after = cm.evaluate(s2)
            for name in base:
                assert parts[name][k, c] == pytest.approx(after[name] - base[name], abs=1e-9), (name, k, c)


def test_min_delta_bounds_every_candidate_delta():
    prob, cm, _ = random_problem(seed=3)
    st = State(prob)
    rows = np.arange(prob.n)
    for t in cm.active_terms(prob):
        assert (t.min_delta(prob, st, rows) <= t.delta(prob, st, rows).min(axis=1) + 1e-9).all(), t.name


def test_incremental_fields_match_recomputation():
    prob, _, rng = random_problem(seed=5)
    st = State(prob)
    for _ in range(20):
        st.set_row(int(rng.integers(prob.n)), prob.cands.row(int(rng.integers(prob.cands.n))))
    np.testing.assert_allclose(st.F, st.S.T @ prob.X, rtol=1e-9, atol=1e-6)


# -- node model ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_topology_from_spec_equals_discovery_of_the_fixture_tree(tmp_path, machine):
    spec = MACHINES[machine]
    found = discover(build_sysfs(spec, tmp_path / "sys"))
    built = topology_from_spec(spec)
    assert built.cpus == found.cpus
    assert [(c.id, c.size_bytes, c.cpus) for c in built.caches_at(3)] == \
        [(c.id, c.size_bytes, c.cpus) for c in found.caches_at(3)]
    distances = {n: v.distances for n, v in found.numa_nodes.items()}
    assert {n: v.distances for n, v in built.numa_nodes.items()} == distances


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_tree_order_makes_every_node_an_interval_and_candidates_laminar(machine):
    node = NodeModel.from_topology(topology_from_spec(MACHINES[machine]))
    assert sorted(node.cpu_ids.tolist()) == sorted(topology_from_spec(MACHINES[machine]).cpus)
    for t in node.tree:
        if t.parent >= 0:
            p = node.tree[t.parent]
            assert p.lo <= t.lo < t.hi <= p.hi
    children: dict[int, list] = {}
    for t in node.tree:
        children.setdefault(t.parent, []).append(t)
    for idx, kids in children.items():
        if idx >= 0:
            parent = node.tree[idx]
            assert [k.lo for k in kids][0] == parent.lo and kids[-1].hi == parent.hi
            assert all(a.hi == b.lo for a, b in zip(kids, kids[1:], strict=False))  # children partition the parent
    prob = Problem.build(node, [ContainerInput(id="x", cpuset=frozenset(node.cpu_ids.tolist()))], RebalancerConfig())
    cand = prob.cands
    for i in range(cand.n):
        for j in range(cand.n):
            a, b = (cand.lo[i], cand.hi[i]), (cand.lo[j], cand.hi[j])
            nested = (a[0] <= b[0] and b[1] <= a[1]) or (b[0] <= a[0] and a[1] <= b[1])
            assert nested or a[1] <= b[0] or b[1] <= a[0]
        # a core's threads are never split
        cores = node.core_of[cand.lo[i]:cand.hi[i]]
        assert all((node.core_of == k).sum() == (cores == k).sum() for k in set(cores.tolist()))


def test_xeon_fixture_has_sst_bf_high_priority_cores_from_base_frequency():
    node = NodeModel.from_topology(topology_from_spec(MACHINES["xeon-2s-112c-snc2"]))
    hp = {int(c) for c, h in zip(node.cpu_ids, node.high_priority, strict=True) if h}
    assert hp == set(MACHINES["xeon-2s-112c-snc2"].base_frequency_overrides_khz)


def test_exclusive_containers_and_reserved_cpus_leave_the_pool():
    node = small_node(cores=4, threads=1)  # CPUs 0-3
    cs = [ContainerInput(id="g", cpuset=frozenset({3}), qos="Guaranteed", cpu_request=1.0),
          ContainerInput(id="b", cpuset=frozenset({0, 1, 2, 3}))]
    prob = Problem.build(node, cs, RebalancerConfig(reserved_cpus="0"))
    order = [c.id for c in prob.containers]  # sorted by id
    assert prob.fixed_reason[order.index("g")] == "exclusive" and prob.movable[order.index("b")]
    pool = {int(node.cpu_ids[p]) for p in np.flatnonzero(prob.pool)}
    assert pool == {1, 2}
    moved = Problem.build(node, cs, RebalancerConfig(move_exclusive=True))
    assert moved.movable.all()


def test_deltas_after_moves_and_restores_equal_those_of_a_fresh_state():
    """Terms keep what they derive from the fields per placement (``State.memo``): every move and every
    restore of a snapshot must drop it, or the next deltas are those of another placement."""
    prob, cm, rng = random_problem(seed=7)
    st = State(prob)
    rows = np.arange(prob.n)
    for step in range(8):
        cm.delta(st, rows)  # fills the memo for this placement
        i = int(rng.integers(prob.n))
        if step % 2:
            snap = st.snapshot(i)
            st.set_row(i, prob.cands.row(int(rng.integers(prob.cands.n))))
            cm.delta(st, rows)
            st.restore(snap)
        else:
            st.set_row(i, prob.cands.row(int(rng.integers(prob.cands.n))))
        fresh = State(prob, st.S.copy())
        got, want = cm.delta(st, rows)[1], cm.delta(fresh, rows)[1]
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-9, err_msg=name)


def test_oversubscription_delta_of_a_few_rows_equals_that_of_all_rows():
    """A few rows take the direct sums over every candidate, many rows the sorted loads of the large ones
    (terms.DIRECT_WORK): both give the same deltas."""
    prob, cm, rng = random_problem(seed=9)
    st = State(prob)
    term = next(t for t in cm.active_terms(prob) if t.name == "oversubscription")
    rows = np.arange(prob.n)
    assert len(rows) * len(prob.cands.member_pos) > terms.DIRECT_WORK
    every = term.delta(prob, st, rows)
    assert np.abs(every).max() > 0
    for chunk in np.array_split(rng.permutation(prob.n), 8):
        assert len(chunk) * len(prob.cands.member_pos) <= terms.DIRECT_WORK
        np.testing.assert_allclose(term.delta(prob, st, chunk), every[chunk], rtol=1e-9, atol=1e-9)
