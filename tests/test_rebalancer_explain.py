"""Explained moves: each pair term's split over (antagonist, victim) adds up to its cost; a move lists the
pairs it separates, the victim and the antagonist the right way round; the relay's move record gets them."""

from __future__ import annotations

import numpy as np
import pytest

from cri_resmgr.config import RebalancerConfig
from cri_resmgr.rebalancer.explain import move_why
from cri_resmgr.rebalancer.model import CostModel
from cri_resmgr.rebalancer.planner import Planner
from cri_resmgr.rebalancer.problem import ContainerInput, NodeModel, Problem, State
from cri_resmgr.rebalancer.scenario import topology_from_spec
from cri_resmgr.rebalancer.simulator import FAMILIES, generate
from cri_resmgr.topology.fixtures import MACHINES


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pair_split_of_every_term_adds_up_to_its_cost(family):
    sc = generate(family, "xeon-2s-112c-snc2", 40, seed=4, numa_bandwidth_bytes_per_second=20e9)
    cfg = sc.config()
    prob = Problem.build(sc.node_model(cfg), sc.inputs(), cfg, now=0.0)
    st = State(prob)
    rows = np.arange(prob.n)
    for t in CostModel(cfg).active_terms(prob):
        split = t.inflicted(prob, st.S, rows)
        if split is None:
            assert t.name == "latency_critical"  # linear: no pairs
            continue
        out, into = split
        assert out.sum() == pytest.approx(t.cost(prob, st), rel=1e-9, abs=1e-12), t.name
        assert np.allclose(out, into.T), t.name  # i inflicts on j what j suffers from i


def test_moves_name_victim_and_antagonist():
    node = NodeModel.from_topology(topology_from_spec(MACHINES["this-vm"]))
    cs = [ContainerInput(id=n, cpuset=frozenset({0, 1}), cpu_usage=1.0, avx512_ratio=r)
          for n, r in (("avx-a", 1.0), ("avx-b", 1.0), ("scalar-a", 0.0), ("scalar-b", 0.0))]
    cfg = RebalancerConfig()
    plan = Planner(cfg).plan(Problem.build(node, cs, cfg))
    assert plan.moves
    pairs = [(s.victim, s.antagonist) for m in plan.moves for s in m.separates if s.term == "avx512_core"]
    assert pairs and all(v.startswith("scalar") and a.startswith("avx") for v, a in pairs), pairs
    for m in plan.moves:
        for s in m.separates:
            assert s.interference_before > s.interference_after >= 0
            assert s.predicted_gain == pytest.approx((s.interference_before - s.interference_after) * 60.0)
        assert sum(m.gain_by_term.values()) == pytest.approx(m.predicted_gain, abs=1e-9)
        why = move_why(m.reason, m.separates)
        assert why.startswith(m.reason) and all(f"victim {s.victim} from antagonist {s.antagonist}" in why
                                                for s in m.separates)


def test_capacity_terms_call_the_heavier_user_the_antagonist():
    sc = generate("bandwidth-hogs", "xeon-2s-112c-snc2", 24, seed=1, numa_bandwidth_bytes_per_second=20e9)
    cfg = sc.config()
    prob = Problem.build(sc.node_model(cfg), sc.inputs(), cfg, now=0.0)
    plan = Planner(cfg).plan(prob)
    bw = {c.id: c.bandwidth() for c in prob.containers}
    seps = [s for m in plan.moves for s in m.separates if s.term == "memory_bandwidth"]
    assert seps
    for s in seps:
        assert bw[s.antagonist] >= bw[s.victim] and s.antagonist_usage == pytest.approx(bw[s.antagonist])
        assert s.usage == "memory_bandwidth_bytes_per_second"


class _Front:
    """The control socket's other end, recording each move as the engine does (placement/api.py MoveRecord)."""

    def __init__(self):
        self.records = []

    def move(self, container_id, cpus, mems, who, why, deadline, gain_by_term=None, separates=None):
        from cri_resmgr.placement.api import MoveRecord

        rec = MoveRecord(time=0.0, container_id=container_id, who=who, why=why, from_cpus="0-1", to_cpus=cpus,
                         from_mems="0", to_mems=mems or "0", result="applied", gain_by_term=gain_by_term or {},
                         separates=separates or [])
        self.records.append(rec)
        return rec

    def moves(self):
        return list(self.records)


def test_the_relay_move_record_carries_the_explanation_over_the_control_socket(tmp_path):
    from cri_resmgr.rebalancer.relay_client import RelayMoveApplier, control_client
    from cri_resmgr.relay.control import serve

    node = NodeModel.from_topology(topology_from_spec(MACHINES["this-vm"]))
    cs = [ContainerInput(id=n, cpuset=frozenset({0, 1}), cpu_usage=1.0, avx512_ratio=r)
          for n, r in (("avx-a", 1.0), ("avx-b", 1.0), ("scalar-a", 0.0), ("scalar-b", 0.0))]
    cfg = RebalancerConfig()
    plan = Planner(cfg).plan(Problem.build(node, cs, cfg))
    m = next(m for m in plan.moves if m.separates)
    front = _Front()
    server = serve(front, tmp_path / "control.sock", lambda: "")
    try:
        from cri_resmgr.rebalancer.explain import Explanation
        from cri_resmgr.sysfs import parse_cpulist

        applier = RelayMoveApplier(control_client(tmp_path / "control.sock"))
        res = applier.apply(m.container_id, parse_cpulist(m.to_cpus), None, move_why(m.reason, m.separates),
                            Explanation.of(m.gain_by_term, m.separates))
        assert res.ok, res
        rec = control_client(tmp_path / "control.sock").moves()[0]
        assert rec.who == "rebalancer" and rec.why.startswith(m.reason) and "separates victim" in rec.why
        assert rec.gain_by_term == pytest.approx(m.gain_by_term)
        assert [(s["victim"], s["antagonist"], s["term"]) for s in rec.separates] == \
            [(s.victim, s.antagonist, s.term) for s in m.separates]
    finally:
        server.stop(0)
