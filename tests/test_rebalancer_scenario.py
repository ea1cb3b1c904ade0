"""Scenario validation (errors name the field), explicit topologies, the simulator's families, and
``cri-resmgr rebalance``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cri_resmgr.cli import main
from cri_resmgr.rebalancer.scenario import Scenario, ScenarioError, load_scenario, parse_scenario
from cri_resmgr.rebalancer.simulator import FAMILIES, generate, simulate
from cri_resmgr.topology.fixtures import MACHINES

AVX_PAIR = {
    "name": "two AVX512 and two scalar containers sharing both CPUs",
    "topology": {"fixture": "this-vm"},
    "containers": [
        {"id": "avx-a", "cpu_usage": 1.0, "cpuset": "0-1", "features": {"avx512_ratio": 0.95}},
        {"id": "avx-b", "cpu_usage": 1.0, "cpuset": "0-1", "features": {"avx512_ratio": 0.9}},
        {"id": "web-a", "cpu_usage": 1.0, "cpuset": "0-1", "qos": "Guaranteed", "cpu_request": 1},
        {"id": "web-b", "cpu_usage": 1.0, "cpuset": "0-1"},
    ],
}


def problems(data) -> list[str]:
    with pytest.raises(ScenarioError) as e:
        parse_scenario(data)
    return e.value.problems


def with_container(**fields):
    return {"topology": {"fixture": "this-vm"}, "containers": [{"id": "x", "cpuset": "0", **fields}]}


def test_errors_name_the_field():
    assert problems({"topology": {"fixture": "this-vm"}, "containers": [{"id": "x"}]}) == \
        ["containers.0.cpuset: Field required"]
    (p,) = problems(with_container(cpuset="3-1"))
    assert p.startswith("containers.0.cpuset:") and "descending range" in p
    (p,) = problems(with_container(color="red"))
    assert p == "containers.0.color: unknown key"
    (p,) = problems(with_container(features={"avx512_ratio": 1.5}))
    assert p.startswith("containers.0.features.avx512_ratio:") and "1.5" in p
    (p,) = problems(with_container(qos="Gold"))
    assert p.startswith("containers.0.qos:")
    (p,) = problems({"topology": {"fixture": "mainframe"}, "containers": []})
    assert p.startswith("topology.fixture:") and "xeon-2s-112c-snc2" in p
    (p,) = problems({"topology": {"fixture": "this-vm", "cpus": [{"id": 0, "core": 0}]}, "containers": []})
    assert p.startswith("topology:") and "exactly one" in p
    (p,) = problems({"topology": {"cpus": [{"id": 0, "core": 0}, {"id": 0, "core": 0}]}, "containers": []})
    assert "CPU ids repeat: 0" in p
    (p,) = problems({**with_container(), "rebalancer": {"weights": {"avx": 1}}})
    assert p == "rebalancer.weights.avx: unknown key"
    assert problems([1, 2]) == ["<root>: expected an object, got list"]


def test_semantic_errors_name_the_container():
    data = {"topology": {"fixture": "this-vm"},
            "containers": [{"id": "a", "cpuset": "0-9"}, {"id": "a", "cpuset": "1"}]}
    assert problems(data) == ["containers.0.cpuset: CPUs 2-9 are not in the topology (0-1)",
                              "containers.1.id: 'a' repeats containers.0.id"]


def test_load_reports_json_syntax_with_line_and_column(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('{"topology": {"fixture": "this-vm"},\n  "containers": [,]}')
    with pytest.raises(ScenarioError) as e:
        load_scenario(f)
    assert e.value.source == str(f) and e.value.problems[0].startswith("line 2, column")
    with pytest.raises(ScenarioError) as e:
        load_scenario(tmp_path / "absent.json")
    assert "cannot read" in e.value.problems[0]


def test_explicit_cpus_topology_with_sst_bf_and_distances():
    sc = parse_scenario({
        "topology": {"cpus": [{"id": i, "core": i - i % 2, "package": i // 4, "numa_node": i // 4, "l3": i // 4,
                               "base_frequency_hz": 2.6e9 if i % 4 < 2 else 2.0e9} for i in range(8)],
                     "l3_size_bytes": 8 * 2**20, "numa_distances": {0: {1: 32}, 1: {0: 32}}},
        "containers": [{"id": "x", "cpuset": "0-7"}],
    })
    topo = sc.build_topology()
    assert {c.id for c in topo.cpus.values() if c.sst_bf_priority == "high"} == {0, 1, 4, 5}
    assert topo.numa_nodes[0].distances == {0: 10, 1: 32}
    assert [c.size_bytes for c in topo.caches_at(3)] == [8 * 2**20, 8 * 2**20]
    node = sc.node_model(sc.config())
    assert node.has_sst_bf and node.numa_distance[0, 1] == pytest.approx(3.2)


def test_schema_describes_the_format():
    schema = Scenario.model_json_schema()
    assert {"topology", "containers"} <= set(schema["required"])
    assert "ScenarioContainer" in schema["$defs"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_generates_valid_deterministic_scenarios_on_every_fixture(family):
    for machine in MACHINES:
        a = generate(family, machine, 30, seed=4)
        assert parse_scenario(json.loads(a.model_dump_json())).containers == a.containers
        assert generate(family, machine, 30, seed=4) == a
        assert generate(family, machine, 30, seed=5) != a
        explicit = generate(family, machine, 10, seed=1, explicit=True)
        assert explicit.topology.cpus is not None

        def used(topo):  # what the model reads; explicit CPUs have no package-local core_id
            return {i: (c.package, c.die, c.core, c.numa_node, c.l3_id, c.base_frequency_hz, c.sst_bf_priority,
                        c.isolated) for i, c in topo.cpus.items()}

        assert used(explicit.build_topology()) == used(a.build_topology())


def test_simulate_applies_moves_between_rounds():
    sc = parse_scenario(AVX_PAIR)
    rounds = simulate(sc, rounds=3)
    first = rounds[0].plan
    assert first.moves and first.cost_after.total < first.cost_before.total
    moved = {m.container_id: m.to_cpus for m in first.moves}
    after = {c.id: c.cpuset for c in rounds[0].scenario.containers}
    assert all(after[k] == v for k, v in moved.items())
    assert not rounds[1].plan.moves and not rounds[2].plan.moves


def test_cli_prints_a_json_plan(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(AVX_PAIR))
    assert main(["rebalance", "--scenario", str(f)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {"moves", "cost_before", "cost_after", "migration_cost", "objective_after"} <= set(plan)
    assert plan["cost_after"]["terms"]["avx512_core"] == 0 < plan["cost_before"]["terms"]["avx512_core"]
    assert plan["migration_cost"] == pytest.approx(sum(m["migration_cost"] for m in plan["moves"]))
    avx = {m["container_id"]: m["to_cpus"] for m in plan["moves"]}
    assert avx, plan
    assert main(["rebalance", "--scenario", str(f), "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rounds"]) == 2 and out["rounds"][1]["moves"] == []


def test_cli_config_base_and_scenario_override(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({**AVX_PAIR, "rebalancer": {"amortization_seconds": 120}}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rebalancer: {max_moves_per_round: 0}\n")
    assert main(["rebalance", "--scenario", str(f), "--config", str(cfg)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["moves"] == [] and plan["amortization_seconds"] == 120


def test_cli_rejects_bad_scenarios_with_exit_2(tmp_path, capsys):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"topology": {"fixture": "this-vm"}, "containers": [{"id": "a", "cpuset": "0-5"}]}))
    assert main(["rebalance", "--scenario", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"invalid scenario ({f})" in err and "containers.0.cpuset: CPUs 2-5 are not in the topology" in err


def test_cli_generate_and_schema_as_a_real_process(tmp_path):
    gen = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--generate", "cache-thrashers",
                          "--machine", "epyc-1s-64c-8l3", "--containers", "12", "--seed", "3"],
                         capture_output=True, text=True, check=True)
    f = tmp_path / "gen.json"
    f.write_text(gen.stdout)
    sc = load_scenario(f)
    assert len(sc.containers) == 12 and sc.topology.fixture == "epyc-1s-64c-8l3"
    run = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--scenario", str(f)],
                         capture_output=True, text=True, check=True)
    plan = json.loads(run.stdout)
    assert plan["moves"] and plan["objective_after"] < plan["objective_before"]
    schema = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--schema"],
                            capture_output=True, text=True, check=True)
    assert json.loads(schema.stdout)["title"] == "Scenario"
    bad = subprocess.run([sys.executable, "-m", "cri_resmgr.cli", "rebalance", "--generate", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown family" in bad.stderr


# -- validation: every problem at once, physical quantities, per-id maps, JSON out ---------------------
SPLIT_CORE = {
    "topology": {"cpus": [{"id": 0, "core": 0, "numa_node": 0}, {"id": 1, "core": 0, "numa_node": 1},
                          {"id": 2, "core": 2, "numa_node": 1}, {"id": 3, "core": 3, "numa_node": 0}],
                 "numa_distances": {"0": {"5": 21}}},
    "capacities": {"numa_bandwidth_bytes_per_second": {"0": 0}, "l3_bandwidth_bytes_per_second": -5},
    "containers": [{"id": "a", "cpuset": "0-1", "cpu_usage": -1}, {"id": "b", "cpuset": "7"},
                   {"id": "b", "cpuset": "0"}],
}


def test_every_problem_is_reported_at_once_with_its_field_path(tmp_path, capsys):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(SPLIT_CORE))
    assert main(["rebalance", "--scenario", str(f)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"invalid scenario ({f}):"
    got = {line.strip().split(":")[0] for line in err[1:]}
    assert got == {
        "capacities.numa_bandwidth_bytes_per_second.0",  # zero capacity: not a physical quantity
        "capacities.l3_bandwidth_bytes_per_second",  # negative
        "containers.0.cpu_usage",
        "containers.1.cpuset",  # CPU 7 is not in the topology
        "containers.2.id",  # repeats containers.1.id
        "topology.cpus.1.numa_node",  # core 0 split across NUMA nodes 0 and 1
        "topology.numa_distances.0.5",  # no NUMA node 5
    }, err
    assert any("core 0 is split: numa_node 1 here, 0 on topology.cpus.0" in line for line in err)
    assert not any("Traceback" in line or "constrained-float" in line for line in err)


def test_capacity_maps_reject_unknown_ids_and_fill_missing_ones_with_the_configured_default():
    base = {"topology": {"fixture": "xeon-2s-112c-snc2"}, "containers": [{"id": "a", "cpuset": "0-3"}],
            "rebalancer": {"numa_bandwidth_bytes_per_second": 42e9}}
    assert problems({**base, "capacities": {"numa_bandwidth_bytes_per_second": {"0": 1e9, "9": 1e9}}}) == [
        "capacities.numa_bandwidth_bytes_per_second.9: no NUMA node 9 in the topology (it has 0-3)"]
    sc = parse_scenario({**base, "capacities": {"numa_bandwidth_bytes_per_second": {"1": 10e9}}})
    node = sc.node_model(sc.config())
    assert list(node.numa_bandwidth) == [42e9, 10e9, 42e9, 42e9]
    assert problems({**base, "capacities": {"numa_bandwidth_bytes_per_second": float("inf")}})
    assert problems({**base, "capacities": {"l3_bandwidth_bytes_per_second": {"0": 0.0}}})


def test_plan_output_is_strict_json(tmp_path, capsys):
    from cri_resmgr.rebalancer.cli import dumps_finite

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))

    assert strict(dumps_finite({"a": float("inf"), "b": [float("nan"), 1.5]})) == {"a": None, "b": [None, 1.5]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps({**AVX_PAIR, "capacities": {"numa_bandwidth_bytes_per_second": 1.0}}))
    assert main(["rebalance", "--scenario", str(f)]) == 0
    plan = strict(capsys.readouterr().out)
    assert plan["cost_before"]["terms"]["memory_bandwidth"] is not None


def test_missing_signals_name_the_collector_not_an_issue_number(tmp_path):
    from cri_resmgr.config import RebalancerConfig
    from cri_resmgr.rebalancer.signals import read_inputs
    from cri_resmgr.store import Sample, Store

    store = Store(600, 10_000)
    store.append("cgroup", 100.0, [Sample("cri_resmgr_container_cpuset_cpus", {"container_id": "a", "cpus": "0-1"},
                                          2.0)], 1.0)
    inputs = read_inputs(store, RebalancerConfig(), 100.0)
    assert len(inputs.missing) == 4
    assert all("issue" not in m and "collectors." in m for m in inputs.missing), inputs.missing
