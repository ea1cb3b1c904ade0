"""The rebalancer service's loop skips the planning of rounds whose inputs have not changed (issue 17): the skip
is counted and reported, and a changed input, configuration or a long enough wait makes it plan again."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from cri_resmgr.rebalancer.problem import ContainerInput
from cri_resmgr.rebalancer.service import held, input_change
from cri_resmgr.rebalancer.signals import Inputs
from cri_resmgr.web.app import create_app

from .test_rebalancer_api import feed, make_agent


def inputs(n: int = 10, **kw) -> Inputs:
    return Inputs([ContainerInput(id=f"{i:064x}", cpuset=frozenset({0, 1}), cpu_usage=0.5, llc_occupancy_bytes=1e6,
                                  memory_bandwidth_bytes_per_second=2e9, **kw) for i in range(n)], [], None)


def changed(ins: Inputs, i: int, **kw) -> Inputs:
    cs = list(ins.containers)
    cs[i] = dataclasses.replace(cs[i], **kw)
    return Inputs(cs, list(ins.missing), ins.high_priority_cpus)


def test_same_inputs_are_unchanged():
    assert input_change(inputs(), inputs(), 0.1) is None


@pytest.mark.parametrize(("field", "small", "large"), [
    ("cpu_usage", 0.55, 0.65),  # against max(0.5, 1 CPU): 0.1 CPU
    ("memory_bandwidth_bytes_per_second", 2.1e9, 2.3e9),  # 10% of 2 GB/s
    ("llc_occupancy_bytes", 1e6 + 0.5 * (8 << 20) * 0.1, 1e6 + 2 * (8 << 20) * 0.1),  # against the 8 MiB floor
    ("avx512_ratio", 0.005, 0.02),  # against 0.1
])
def test_one_container_changes_beyond_the_threshold(field, small, large):
    ins = inputs()
    assert input_change(ins, changed(ins, 3, **{field: small}), 0.1) is None
    why = input_change(ins, changed(ins, 3, **{field: large}), 0.1)
    short_id = f"{3:064x}"[:12]
    assert why is not None and why.startswith(f"{field} of {short_id}: "), why


def test_small_changes_add_up():
    ins = inputs(100)
    drift = Inputs([dataclasses.replace(c, cpu_usage=c.cpu_usage + 0.09) for c in ins.containers], [], None)
    assert input_change(ins, changed(ins, 7, cpu_usage=0.59), 0.1) is None  # each one alone is below
    why = input_change(ins, drift, 0.1)
    assert why is not None and why.startswith("cpu_usage: containers moved")


def test_a_signal_not_measured_holds_its_last_value_and_a_first_measurement_is_a_change():
    ins = changed(inputs(), 4, memory_bandwidth_bytes_per_second=None)
    assert input_change(inputs(), ins, 0.1) is None  # (RDT rotation: not watched in this window)
    why = input_change(ins, inputs(), 0.1)
    assert why is not None and "measured for the first time" in why
    # the reference keeps what was last measured, so a later change against it is seen
    ref = held(inputs(), ins)
    assert ref.containers[4].memory_bandwidth_bytes_per_second == 2e9 and ref.containers[0] is ins.containers[0]
    assert input_change(ref, changed(inputs(), 4, memory_bandwidth_bytes_per_second=5e9), 0.1) is not None


def test_budgeted_signals_not_measured_hold_but_cpu_use_dropping_to_zero_is_a_change():
    ins = inputs()
    unwatched = changed(ins, 2, llc_occupancy_bytes=None)  # its RDT group rotated out for this window
    assert input_change(ins, unwatched, 0.1) is None
    assert held(ins, unwatched).containers[2].llc_occupancy_bytes == 1e6
    assert input_change(ins, changed(ins, 2, cpu_usage=0.0), 0.1) is not None


def test_a_budgeted_signal_measured_at_zero_is_a_change():
    """A container whose LLC misses were measured and drop to a measured 0 (it stopped thrashing) has changed:
    only a value not measured (None) holds the last one."""
    ins = inputs(llc_misses_per_second=3e8)
    assert input_change(ins, changed(ins, 2, llc_misses_per_second=0.0), 0.1) is not None
    assert input_change(ins, changed(ins, 2, llc_misses_per_second=None), 0.1) is None


@pytest.mark.parametrize("what", ["cpuset", "new container", "gone", "annotation", "signals"])
def test_anything_but_the_signals_must_be_equal(what):
    ins = inputs()
    other = {"cpuset": lambda: changed(ins, 0, cpuset=frozenset({1})),
             "new container": lambda: inputs(11),
             "gone": lambda: inputs(9),
             "annotation": lambda: changed(ins, 5, annotations={"a": "b"}),
             "signals": lambda: Inputs(ins.containers, ["llc_misses_per_second (no ...)"], None)}[what]()
    assert input_change(ins, other, 0.1) is not None


def rounds_metric(client, result: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'cri_resmgr_rebalancer_rounds_total{{result="{result}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no rounds_total{{result={result!r}}}")


def test_unchanged_round_is_skipped_reported_and_a_change_plans_again(tmp_path):
    a = make_agent(tmp_path, window_seconds=30)
    try:
        svc, c = a.rebalancer, TestClient(create_app(a))
        feed(a, rounds=3)
        first = svc.tick()
        assert first is not None and first.error is None and first.plan is not None
        # nothing new collected: the same inputs, nothing planned or recorded
        assert svc.tick() is None
        assert len(svc.engine.history) == 1 and svc.gate.skipped_total == 1 and svc.gate.planned_total == 1
        st = c.get("/api/v1/rebalancer/plan").json()
        assert st["rounds_skipped_total"] == 1 and "no input changed by more than 10%" in st["last_skip_reason"]
        assert st["last"] == first.model_dump(mode="json")
        assert rounds_metric(c, "skipped") == 1 and rounds_metric(c, "planned") == 1
        # the same load collected again: still within the threshold
        feed(a, rounds=2)
        assert svc.tick() is None and svc.gate.skipped_total == 2
        # the containers' CPU use drops from 0.9 to about 0.1 CPU: planned again, and recorded
        feed(a, rounds=6, usage_step_us=100_000)
        again = svc.tick()
        assert again is not None and again.plan is not None and len(svc.engine.history) == 2
        assert rounds_metric(c, "planned") == 2
    finally:
        a.stop()


def test_config_change_or_max_skip_plans_again(tmp_path):
    a = make_agent(tmp_path, window_seconds=30)
    try:
        svc = a.rebalancer
        feed(a, rounds=3)
        assert svc.tick() is not None and svc.tick() is None
        # a reload with a different rebalancer configuration: planned
        a.config_state.active = a.cfg.model_copy(
            update={"rebalancer": a.cfg.rebalancer.model_copy(update={"min_net_gain": 2.0})})
        assert svc.tick() is not None and svc.tick() is None
        # the topology rediscovered: planned
        a.topology = dataclasses.replace(a.topology)
        assert svc.tick() is not None and svc.tick() is None
        # max_skip_seconds 0: every round planned, whatever changed
        a.config_state.active = a.cfg.model_copy(
            update={"rebalancer": a.cfg.rebalancer.model_copy(update={"max_skip_seconds": 0.0})})
        assert svc.tick() is not None and svc.tick() is not None
        assert svc.gate.skipped_total == 3
    finally:
        a.stop()


def test_a_failed_round_is_not_skipped(tmp_path):
    a = make_agent(tmp_path, window_seconds=30)
    try:
        svc = a.rebalancer
        feed(a, rounds=3)
        assert svc.tick() is not None
        broken = svc.engine.last.model_copy(update={"error": "RuntimeError: boom"})
        svc.engine.history.append(broken)
        assert svc.tick() is not None  # retried, not skipped
        assert svc.tick() is None
    finally:
        a.stop()
