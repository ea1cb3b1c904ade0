"""The executor on a fixture cgroup tree: inputs from the store as the real cgroup collector fills it,
modes advise/enforce, CgroupMoveApplier writes, outcomes, missing signals and metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from cri_resmgr import metrics as M
from cri_resmgr.collectors.cgroup import CgroupCollector
from cri_resmgr.config import CgroupCollectorConfig, ExtraCgroup, RebalancerConfig
from cri_resmgr.rebalancer.executor import CgroupMoveApplier, Rebalancer
from cri_resmgr.rebalancer.scenario import topology_from_spec
from cri_resmgr.rebalancer.signals import AVX512_RATIO, read_inputs
from cri_resmgr.store import Sample, Store
from cri_resmgr.sysfs import parse_cpulist
from cri_resmgr.topology.fixtures import MACHINES

from .cgroupfs import Values, make_v1

NAMES = ("avx-a", "avx-b", "scalar-a", "scalar-b")
AVX_OVERRIDES = [{"match": {"container": n}, "avx512_ratio": 1.0} for n in ("avx-a", "avx-b")]


class Node:
    """A v1 fixture tree with four extra cgroups on CPUs 0-1 whose CPU usage advances 1 s per second."""

    def __init__(self, root: Path):
        self.root = root
        self.col = CgroupCollector(root, CgroupCollectorConfig(
            extra_cgroups=[ExtraCgroup(name=n, path=f"demo/{n}", namespace="demo") for n in NAMES]))
        self.store = Store(600)
        self.t = 1000.0
        for n in NAMES:
            make_v1(root, f"demo/{n}", Values(usage_ns=0, cpus="0-1"))
            (root / "cpuset/demo" / n / "cpuset.mems").write_text("0\n")

    def cpus(self, name: str) -> frozenset[int]:
        return parse_cpulist((self.root / "cpuset/demo" / name / "cpuset.cpus").read_text())

    def advance(self, seconds: int = 4) -> None:
        for _ in range(seconds):
            self.t += 1.0
            for n in NAMES:
                f = self.root / "cpuacct/demo" / n / "cpuacct.usage"
                f.write_text(str(int(f.read_text()) + 1_000_000_000))
                # the kernel's effective cpus follow cpuset.cpus (no parent restriction here)
                (self.root / "cpuset/demo" / n / "cpuset.effective_cpus").write_text(
                    (self.root / "cpuset/demo" / n / "cpuset.cpus").read_text())
            self.store.append("cgroup", self.t, self.col.collect(self.t), 1.0)

    def rebalancer(self, **cfg) -> Rebalancer:
        conf = RebalancerConfig.model_validate({"window_seconds": 3, "overrides": AVX_OVERRIDES, **cfg})
        topo = topology_from_spec(MACHINES["this-vm"])

        def resolve(cid):
            info = self.col.containers.get(cid)
            return info.identity.cgroup_path if info else None

        return Rebalancer(self.store, lambda: topo, lambda: conf,
                          applier=lambda c: CgroupMoveApplier(self.root, resolve), cpusets=self.col.cpusets)


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path / "cgroup")
    n.advance()
    return n


def metric(store: Store, name: str, **labels) -> float | None:
    for ref, _t, v in store.latest(name):
        if all(ref.label_dict.get(k) == val for k, val in labels.items()):
            return v
    return None


def test_inputs_come_from_the_store_window_with_overrides_and_missing_signals(node):
    inputs = read_inputs(node.store, RebalancerConfig(window_seconds=3, overrides=AVX_OVERRIDES), node.t,
                         cpusets=node.col.cpusets())
    by = {c.name: c for c in inputs.containers}
    assert set(by) == set(NAMES)
    assert all(c.cpuset == {0, 1} for c in by.values())
    assert all(c.cpu_usage == pytest.approx(1.0) for c in by.values())  # 1 CPU-second per second
    assert by["avx-a"].avx512_ratio == 1.0 and by["scalar-a"].avx512_ratio == 0.0
    assert any(m.startswith("avx512_ratio") and "overrides" in m for m in inputs.missing)
    assert any(m.startswith("memory_bandwidth") for m in inputs.missing)
    # once the AVX512 collector writes its series, the ratio is read and no longer missing
    for t in (node.t - 2, node.t - 1, node.t):
        labels = {"container_id": "scalar-b", "container": "scalar-b"}
        node.store.append("avx512", t, [Sample(AVX512_RATIO, labels, 0.6)])
    inputs = read_inputs(node.store, RebalancerConfig(window_seconds=3), node.t, cpusets=node.col.cpusets())
    assert {c.name: c.avx512_ratio for c in inputs.containers}["scalar-b"] == pytest.approx(0.6)
    assert not any(m.startswith("avx512_ratio") for m in inputs.missing)


def test_advise_plans_without_touching_cgroups(node):
    rb = node.rebalancer(mode="advise")
    rec = rb.run_once(now=node.t)
    assert rec.plan is not None and rec.plan.moves and rec.error is None
    assert all(o.result == "advised" for o in rec.outcomes)
    assert all(node.cpus(n) == {0, 1} for n in NAMES)
    assert metric(node.store, M.REBALANCER_MOVES.name, result="advised") == len(rec.outcomes)
    assert metric(node.store, M.REBALANCER_COST.name, when="before") == pytest.approx(rec.plan.cost_before.total)
    cost = M.REBALANCER_COST.name
    assert metric(node.store, cost, when="after") < metric(node.store, cost, when="before")
    assert metric(node.store, M.REBALANCER_PLAN_DURATION.name) > 0


def test_enforce_writes_cpusets_then_settles(node):
    rb = node.rebalancer(mode="enforce", cooldown_seconds=0)
    rec = rb.run_once(now=node.t)
    assert rec.outcomes and all(o.result == "applied" for o in rec.outcomes), rec.outcomes
    for o in rec.outcomes:
        assert node.cpus(o.container_id) == parse_cpulist(o.to_cpus)
    avx = node.cpus("avx-a") | node.cpus("avx-b")
    scalar = node.cpus("scalar-a") | node.cpus("scalar-b")
    assert not avx & scalar
    assert (node.root / "cpuset/demo/avx-a/cpuset.mems").read_text().strip() == "0"
    assert set(rb.last_moved) == {o.container_id for o in rec.outcomes}
    for _ in range(5):  # the store sees the new cpusets; nothing moves again
        node.advance(2)
        later = rb.run_once(now=node.t)
        assert later.plan is not None and not later.outcomes, later
    assert metric(node.store, M.REBALANCER_MOVES.name, result="applied") == len(rec.outcomes)
    assert len(rb.history) == 6


def test_enforce_records_failures_and_the_round_goes_on(node, tmp_path):
    rb = node.rebalancer(mode="enforce")
    rb.applier = lambda cfg: CgroupMoveApplier(tmp_path / "elsewhere", lambda cid: f"demo/{cid}")
    rec = rb.run_once(now=node.t)
    assert rec.outcomes and all(o.result == "failed" and "no cgroup hierarchy" in o.error for o in rec.outcomes)
    assert all(node.cpus(n) == {0, 1} for n in NAMES) and not rb.last_moved
    rb.applier = lambda cfg: None
    rec = rb.run_once(now=node.t + 1)
    assert rec.outcomes and all("no move applier" in o.error for o in rec.outcomes)
    assert metric(node.store, M.REBALANCER_MOVES.name, result="failed") == 2 * len(rec.outcomes)


def test_cgroup_applier_reports_unknown_containers_and_missing_files(node):
    ap = CgroupMoveApplier(node.root, lambda cid: None)
    assert "no known cgroup" in ap.apply("x", frozenset({0}), None, "").error
    ap = CgroupMoveApplier(node.root, lambda cid: "demo/absent")
    assert "cpuset.cpus does not exist" in ap.apply("x", frozenset({0}), None, "").error
    ap = CgroupMoveApplier(node.root, lambda cid: f"demo/{cid}")
    res = ap.apply("avx-a", frozenset({1}), frozenset({0}), "test")
    assert res.ok and res.cpus == {1} and node.cpus("avx-a") == {1}


def test_a_failing_round_is_recorded_not_raised(node):
    rb = node.rebalancer()
    rb.topology = lambda: topology_from_spec(MACHINES["this-vm"]).__class__()  # no CPUs
    rec = rb.run_once(now=node.t)
    assert rec.plan is None and "no online CPUs" in rec.error
    assert len(rb.history) == 1


def test_no_containers_yet_is_a_quiet_round(tmp_path):
    rb = Rebalancer(Store(60), lambda: topology_from_spec(MACHINES["this-vm"]), lambda: RebalancerConfig())
    rec = rb.run_once(now=1.0)
    assert rec.plan is None and rec.error == "no containers in the store yet"


class _RelayCache:
    """A metadata source like the relay's cache that knows only some containers."""

    def __init__(self, known):
        self.known = known

    def metadata(self):
        from cri_resmgr.rebalancer.signals import ContainerMetadata

        return {cid: ContainerMetadata(qos="Burstable") for cid in self.known}


def test_with_the_relay_as_applier_only_containers_it_knows_are_moved(node):
    rb = node.rebalancer(mode="enforce", cooldown_seconds=0, applier="relay")
    rb.metadata = _RelayCache({"avx-a", "scalar-a"})
    rec = rb.run_once(now=node.t)
    assert rec.plan is not None
    moved = {m.container_id for m in rec.plan.moves}
    assert moved and moved <= {"avx-a", "scalar-a"}, rec.plan.moves
    assert node.cpus("avx-b") == node.cpus("scalar-b") == {0, 1}  # not moved: the relay would refuse them
    # The same metadata with the cgroup applier restricts nothing.
    rb2 = node.rebalancer(mode="advise", cooldown_seconds=0, applier="cgroup")
    rb2.metadata = _RelayCache({"avx-a"})
    inputs = read_inputs(node.store, RebalancerConfig(window_seconds=3, overrides=AVX_OVERRIDES), node.t,
                         metadata=rb2.metadata.metadata(), cpusets=node.col.cpusets(), only_known=False)
    assert all(c.pinned_reason is None for c in inputs.containers)
    inputs = read_inputs(node.store, RebalancerConfig(window_seconds=3, overrides=AVX_OVERRIDES), node.t,
                         metadata=rb2.metadata.metadata(), cpusets=node.col.cpusets(), only_known=True)
    assert {c.id for c in inputs.containers if c.pinned_reason == "not known to the relay"} == {
        "avx-b", "scalar-a", "scalar-b"}
