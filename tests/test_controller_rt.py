"""Real-time groups on the real cgroup v1 cpu controller (Documentation/scheduler/sched-rt-group.rst):
grants reach the container and its parents, SCHED_FIFO then works in the container and not without,
the node's budget refuses what does not fit, and releases give the runtime back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cri_resmgr.config import build_config
from cri_resmgr.placement.controllers.base import Applied, ControlError, Plan
from cri_resmgr.placement.controllers.rt import RUNTIME, RtController, needed_runtimes

from .controller_cgroups import CGROUP, Sandbox, context, unavailable

FIFO_PROBE = ("import os, sys\n"
              "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
              "try:\n    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))\n    print('ok')\n"
              "except PermissionError:\n    print('EPERM')\n")


def section(classes: dict):
    return build_config({"controls": {"rt": {"classes": classes}}}, env={}).controls.rt


@pytest.fixture
def sandbox():
    why = unavailable("cpu")
    if why:
        pytest.skip(why)
    if not (CGROUP / "cpu" / RUNTIME).exists():
        pytest.skip("kernel without CONFIG_RT_GROUP_SCHED")
    sb = Sandbox(("cpu",))
    yield sb
    sb.cleanup()


def runtime(sb: Sandbox, rel: str = "") -> int:
    return int((sb.dir("cpu", f"{sb.top}/{rel}" if rel else sb.top) / RUNTIME).read_text())


def fifo_in(cgroup_dir: Path) -> str:
    return subprocess.run([sys.executable, "-c", FIFO_PROBE, str(cgroup_dir / "cgroup.procs")], check=True,
                          capture_output=True, text=True).stdout.strip()


def test_needed_runtimes_sums_children_and_counts_unmanaged_siblings():
    children = {"": ["k", "other"], "k": ["k/p1", "k/p2", "k/x"], "k/p1": ["k/p1/c"], "k/p2": ["k/p2/c"]}
    grants = {"k/p1/c": 10000, "k/p2/c": 20000}
    managed = {"k", "k/p1", "k/p2", "k/p1/c", "k/p2/c"}
    need = needed_runtimes(grants, managed, {"k/x": 5000, "other": 100000}, children)
    assert need == {"k/p1/c": 10000, "k/p1": 10000, "k/p2/c": 20000, "k/p2": 20000, "k": 35000}


def test_grant_reaches_every_parent_and_lets_the_container_use_sched_fifo(sandbox):
    ctrl = RtController(CGROUP)
    p = ctrl.prepare(section({"rt": {"runtime_us": 20000}}))
    assert isinstance(p, Plan), p
    path = sandbox.container("pod", "c1")
    assert fifo_in(sandbox.dir("cpu", path)) == "EPERM"  # a fresh cgroup has no RT runtime
    ctrl.enforce(context(path), "rt", p)
    assert (runtime(sandbox), runtime(sandbox, "pod"), runtime(sandbox, "pod/c1")) == (20000, 20000, 20000)
    assert fifo_in(sandbox.dir("cpu", path)) == "ok"

    path2 = sandbox.container("pod2", "c2")
    ctrl.enforce(context(path2), "rt", p)
    assert (runtime(sandbox), runtime(sandbox, "pod"), runtime(sandbox, "pod2/c2")) == (40000, 20000, 20000)

    ctrl.release(context(path), Applied("rt"), p)
    assert (runtime(sandbox), runtime(sandbox, "pod"), runtime(sandbox, "pod/c1")) == (20000, 0, 0)
    ctrl.release(context(path2), Applied("rt"), p)
    assert (runtime(sandbox), runtime(sandbox, "pod2")) == (0, 0)


def test_grant_over_the_nodes_budget_is_refused_and_others_keep_theirs(sandbox):
    ctrl = RtController(CGROUP)
    budget = int((CGROUP / "cpu" / RUNTIME).read_text())
    big = budget // 2 + 1000
    p = ctrl.prepare(section({"big": {"runtime_us": big}}))
    assert isinstance(p, Plan), p
    a, b = sandbox.container("p1", "a"), sandbox.container("p2", "b")
    ctrl.enforce(context(a), "big", p)
    with pytest.raises(ControlError, match=r"over the node's RT budget"):
        ctrl.enforce(context(b), "big", p)
    assert (runtime(sandbox), runtime(sandbox, "p1/a"), runtime(sandbox, "p2/b")) == (big, big, 0)
    ctrl.release(context(a), Applied("big"), p)
    assert runtime(sandbox) == 0


def test_class_larger_than_the_node_budget_is_a_config_problem():
    if not (CGROUP / "cpu" / RUNTIME).exists():
        pytest.skip("kernel without CONFIG_RT_GROUP_SCHED")
    budget = int((CGROUP / "cpu" / RUNTIME).read_text())
    problems = RtController(CGROUP).prepare(section({"huge": {"runtime_us": budget + 1}}))
    assert problems == [f"controls.rt.classes.huge.runtime_us: {budget + 1} µs exceeds the node's RT budget of "
                        f"{budget} µs per 1000000 µs (root cpu.rt_runtime_us)"]


def test_kernel_without_rt_group_scheduling_refuses_classes(tmp_path):
    # A cpu hierarchy as a kernel without CONFIG_RT_GROUP_SCHED shows it: no cpu.rt_* files at all.
    (tmp_path / "cpu").mkdir()
    for f in ("cgroup.procs", "cpu.shares", "cpu.cfs_quota_us"):
        (tmp_path / "cpu" / f).write_text("")
    problems = RtController(tmp_path).prepare(section({"rt": {"runtime_us": 1000}}))
    assert problems == [f"controls.rt.classes: the kernel lacks RT group scheduling (CONFIG_RT_GROUP_SCHED): no "
                        f"cpu.rt_runtime_us in {tmp_path / 'cpu'}"]
    assert isinstance(RtController(tmp_path).prepare(section({})), Plan)  # no classes: nothing to refuse


def test_kernel_refusal_is_reported_with_errno(sandbox):
    # An RT task in a group pins its runtime: lowering it to 0 fails EBUSY (sched-rt-group.rst).
    ctrl = RtController(CGROUP, lower_patience_seconds=0.2)
    p = ctrl.prepare(section({"rt": {"runtime_us": 10000}}))
    assert isinstance(p, Plan)
    path = sandbox.container("pod", "c1")
    ctrl.enforce(context(path), "rt", p)
    d = sandbox.dir("cpu", path)
    proc = subprocess.Popen([sys.executable, "-c", FIFO_PROBE + "import time; time.sleep(30)\n",
                             str(d / "cgroup.procs")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
        with pytest.raises(ControlError, match=r"cpu.rt_runtime_us: EBUSY"):
            ctrl.release(context(path), Applied("rt"), p)
    finally:
        proc.kill()
        proc.wait()


def test_rt_throttling_off_gives_the_whole_period_as_budget(tmp_path):
    # sched_rt_runtime_us = -1 (RT throttling off) shows as -1 in the root group's cpu.rt_runtime_us.
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cgroup.procs").write_text("")
    (tmp_path / "cpu" / "cpu.rt_period_us").write_text("1000000\n")
    (tmp_path / "cpu" / RUNTIME).write_text("-1\n")
    p = RtController(tmp_path).prepare(section({"all": {"runtime_us": 1000000}}))
    assert isinstance(p, Plan) and (p.details.period_us, p.details.runtime_us) == (1000000, 1000000)


def test_grants_of_containers_stopped_while_down_are_given_back_at_the_next_start(sandbox, tmp_path):
    """The front end grants two containers, dies, one container stops meanwhile: the next start gives its
    runtime back (pod and top level), keeps the live container's grant, and touches nothing it did not write."""
    ledger = tmp_path / "rt-grants.json"
    first = RtController(CGROUP, ledger=ledger)
    p = first.prepare(section({"rt": {"runtime_us": 20000}}))
    assert isinstance(p, Plan), p
    first.commit(p)
    live, gone = sandbox.container("pod1", "c1"), sandbox.container("pod2", "c2")
    foreign = sandbox.mkdir("cpu", "other")
    (sandbox.dir("cpu") / RUNTIME).write_text("5000")
    (foreign / RUNTIME).write_text("5000")  # a group someone else runs RT tasks in
    first.enforce(context(live), "rt", p)
    first.enforce(context(gone), "rt", p)
    assert (runtime(sandbox), runtime(sandbox, "pod2")) == (45000, 20000)
    del first  # kill -9: nothing released

    sandbox.dir("cpu", gone).rmdir()  # the container stopped and its cgroup went while nobody watched
    second = RtController(CGROUP, ledger=ledger)
    assert second.commit(second.prepare(section({"rt": {"runtime_us": 20000}}))) == []
    assert (runtime(sandbox), runtime(sandbox, "pod1"), runtime(sandbox, "pod1/c1")) == (25000, 20000, 20000)
    assert runtime(sandbox, "pod2") == 0 and runtime(sandbox, "other") == 5000
    assert fifo_in(sandbox.dir("cpu", live)) == "ok"  # the live container still runs RT tasks
    assert json.loads(ledger.read_text())["grants"] == {live.strip("/"): 20000}


@pytest.mark.parametrize("content", [b"{not json", b'{"version": 1, "grants": {"a": -1}, "touched": []}',
                                     b'{"version": 7}', b"[]"])
def test_an_unusable_ledger_is_ignored_and_the_start_goes_on(sandbox, tmp_path, content):
    ledger = tmp_path / "rt-grants.json"
    ledger.write_bytes(content)
    ctrl = RtController(CGROUP, ledger=ledger)
    p = ctrl.prepare(section({"rt": {"runtime_us": 10000}}))
    assert isinstance(p, Plan) and ctrl.commit(p) == []
    path = sandbox.container("pod", "c")
    ctrl.enforce(context(path), "rt", p)
    assert runtime(sandbox) == 10000
    assert json.loads(ledger.read_text())["grants"] == {path.strip("/"): 10000}
