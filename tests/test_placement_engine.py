"""The placement engine on its own (no HTTP/2, no gRPC): reservations, the pool, reconcile, invariants,
persistence, supervision, controllers.

The runtime is an emulator (:class:`EmulatedRuntime`) that keeps containers the way a runtime does and writes
each container's cpuset where runc would: ``<cgroup root>/cpuset/<cgroup_parent>/<id>/cpuset.cpus`` in a
cgroup v1 fixture tree. The engine reads the invariants from those files, as it reads the kernel's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cri_resmgr import metrics as M
from cri_resmgr.placement.allocator import InsufficientCpus
from cri_resmgr.placement.context import ContainerContext
from cri_resmgr.placement.engine import ContainerRequest, Engine, EngineSettings
from cri_resmgr.placement.estimate import Resources
from cri_resmgr.placement.model import Kind, State
from cri_resmgr.placement.runtime import ContainerRecord, PodRecord, RuntimeCallError, RuntimeSnapshot
from cri_resmgr.sysfs import format_cpulist, parse_cpulist
from cri_resmgr.topology import discover
from cri_resmgr.topology.fixtures import MachineSpec, build_sysfs

FOUR = MachineSpec("four", packages=1, dies_per_package=1, cores_per_die=4, threads_per_core=1,
                   numa_per_package=1, l3_per_die=1)
PARENT = {"Guaranteed": "/kubepods/pod{uid}", "Burstable": "/kubepods/burstable/pod{uid}",
          "BestEffort": "/kubepods/besteffort/pod{uid}"}


def resources(qos: str, milli: int = 0) -> Resources:
    if qos == "BestEffort":
        return Resources(cpu_shares=2)
    shares = max(2, milli * 1024 // 1000)
    return Resources(cpu_shares=shares, cpu_quota=milli * 100 if qos == "Guaranteed" else 0, cpu_period=100000,
                     memory_limit_bytes=64 << 20)


class EmulatedRuntime:
    """A runtime as the engine sees it through its port, with cgroup cpuset files it writes like runc."""

    def __init__(self, cgroup_root: Path, online: frozenset[int]):
        self.root = cgroup_root
        (cgroup_root / "cpuacct").mkdir(parents=True)
        (cgroup_root / "cpuset").mkdir()
        self.online = online
        self.pods: dict[str, PodRecord] = {}
        self.containers: dict[str, ContainerRecord] = {}
        self.updates: list[tuple[str, str]] = []
        self.hang = threading.Event()  # set: update_cpuset blocks until release is set
        self.release = threading.Event()
        self.snapshot_delay = 0.0
        self.snapshot_error: Exception | None = None
        self.after_list: Callable[[], None] | None = None  # runs once the snapshot's lists are taken
        self.lock = threading.Lock()

    def cpuset_file(self, cid: str) -> Path:
        c = self.containers[cid]
        return self.root / "cpuset" / c.cgroup_parent.lstrip("/") / cid / "cpuset.cpus"

    def kernel_cpus(self, cid: str) -> frozenset[int]:
        return parse_cpulist(self.cpuset_file(cid).read_text().strip())

    def run_pod(self, name: str, qos: str) -> PodRecord:
        uid = f"uid-{name}"
        p = PodRecord(id=f"pod-{name}", name=name, namespace="default", uid=uid,
                      cgroup_parent=PARENT[qos].format(uid=uid))
        self.pods[p.id] = p
        return p

    def create(self, pod: PodRecord, name: str, cpus: str, res: Resources | None = None,
               state: State = State.CREATED) -> str:
        cid = f"{pod.name}-{name}"
        if res is not None:
            res = dataclasses.replace(res, cpuset_cpus=cpus)
        self.containers[cid] = ContainerRecord(id=cid, pod_id=pod.id, name=name, state=state, resources=res,
                                               cgroup_parent=pod.cgroup_parent)
        f = self.cpuset_file(cid)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text((cpus or format_cpulist(self.online)) + "\n")
        return cid

    def set_state(self, cid: str, state: State) -> None:
        c = self.containers[cid]
        self.containers[cid] = ContainerRecord(c.id, c.pod_id, c.name, state, c.annotations, c.resources,
                                               c.cgroup_parent)

    # -- RuntimePort --------------------------------------------------------------------------------
    def update_cpuset(self, container_id: str, cpus: str, mems: str, resources: str, timeout: float) -> str:
        if self.hang.is_set() and not self.release.wait(timeout):
            raise RuntimeCallError("UpdateContainerResources: DEADLINE_EXCEEDED", unavailable=True)
        with self.lock:
            if container_id not in self.containers:
                raise RuntimeCallError("NOT_FOUND", not_found=True)
            self.updates.append((container_id, cpus))
            self.cpuset_file(container_id).write_text(cpus + "\n")
        return resources

    def snapshot(self, timeout: float, known: frozenset[str]) -> RuntimeSnapshot:
        time.sleep(self.snapshot_delay)
        if self.snapshot_error is not None:
            raise self.snapshot_error
        snap = RuntimeSnapshot(list(self.pods.values()), list(self.containers.values()))
        if self.after_list is not None:
            self.after_list()
        return snap

    def describe(self) -> str:
        return "emulated"


@pytest.fixture
def node(tmp_path):
    topo = discover(build_sysfs(FOUR, tmp_path / "sys"))
    rt = EmulatedRuntime(tmp_path / "cgroup", frozenset(topo.cpus))
    (tmp_path / "state").mkdir()
    engines: list[Engine] = []

    def make(**settings) -> Engine:
        s = EngineSettings(**{"start_hold_seconds": 5.0, "runtime_timeout_seconds": 5.0, **settings})
        e = Engine(s, topo, tmp_path / "state", rt, cgroup_root=tmp_path / "cgroup")
        engines.append(e)
        return e

    yield rt, make
    for e in engines:
        e.stop()


def create(engine: Engine, rt: EmulatedRuntime, pod: PodRecord, name: str, qos: str, milli: int = 0) -> str:
    """A create as a front end does it: place, runtime creates with the reserved cpuset, commit."""
    res = resources(qos, milli)
    r = engine.place(ContainerRequest(pod.id, name, pod.namespace, pod.name, pod.uid, pod.cgroup_parent, {}, {}, res))
    cid = rt.create(pod, name, r.cpus, res)
    engine.commit(r, cid)
    return cid


def start(engine: Engine, rt: EmulatedRuntime, cid: str) -> None:
    assert engine.wait_startable(cid, 10), f"{cid} never became startable"
    rt.set_state(cid, State.RUNNING)
    engine.started(cid)


def wait_for(cond, timeout: float = 10, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_unknown_is_not_exited_and_keeps_its_cpus(node):
    rt, make = node
    e = make(min_shared_cpus=2)
    for name in ("a", "b"):
        e.pod_added(rt.run_pod(name, "Guaranteed"))
    a = create(e, rt, rt.pods["pod-a"], "app", "Guaranteed", 2000)
    start(e, rt, a)
    held = e.container(a).cpu_set
    rt.set_state(a, State.UNKNOWN)  # containerd restarted and has not loaded it yet
    e.reconcile()
    assert e.container(a).state == State.UNKNOWN and e.state().exclusive == {a: format_cpulist(held)}
    with pytest.raises(InsufficientCpus):  # the 2 other CPUs must stay shared: nothing was freed
        create(e, rt, rt.pods["pod-b"], "app", "Guaranteed", 1000)
    rt.set_state(a, State.RUNNING)
    assert e.reconcile().violations == 0 and e.container(a).cpu_set == held == rt.kernel_cpus(a)


def test_a_resize_reserves_its_new_cpus_like_a_create(node):
    rt, make = node
    e = make()
    for name in ("a", "b"):
        e.pod_added(rt.run_pod(name, "Guaranteed"))
    a = create(e, rt, rt.pods["pod-a"], "app", "Guaranteed", 1000)
    grow = e.resize(a, resources("Guaranteed", 2000))
    assert grow is not None and len(parse_cpulist(grow.cpus)) == 2
    # while the runtime applies the resize, a create must not get the CPUs the resize reserved
    b = create(e, rt, rt.pods["pod-b"], "app", "Guaranteed", 1000)
    assert not e.container(b).cpu_set & parse_cpulist(grow.cpus)
    e.commit(grow)
    excl = e.state().exclusive
    assert parse_cpulist(excl[a]) == parse_cpulist(grow.cpus) and not parse_cpulist(excl[a]) & parse_cpulist(excl[b])
    # a resize the runtime refused returns its CPUs
    shrink = e.resize(a, resources("Guaranteed", 1000))
    e.abort(shrink)
    assert e.state().exclusive[a] == excl[a] and e.state().pending == 0


def test_concurrent_reconciles_adopt_once_and_never_demote(node):
    rt, make = node
    e = make()
    p = rt.run_pod("g", "Guaranteed")
    cid = rt.create(p, "app", "3", resources("Guaranteed", 1000), state=State.RUNNING)  # created behind its back
    rt.snapshot_delay = 0.2  # both reconciles are in flight at once
    results = []
    threads = [threading.Thread(target=lambda: results.append(e.reconcile())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.containers_added for r in results) == [0, 1]
    c = e.container(cid)
    assert (c.placement, c.cpus, c.reason) == (Kind.EXCLUSIVE, "3", "adopted at resync")


def test_a_reconcile_judges_only_what_its_runtime_list_could_have_seen(node):
    """The lists of a reconcile are taken before the front end's latest calls reach the books: a Guaranteed
    create committed and started after them, a start, a pod removed. The reconcile must not find the new
    container gone (seen under chaos: its CPU went back to the shared pool, and a BestEffort container ran on
    it beside it), move a started container back to created, nor bring the removed pod back."""
    rt, make = node
    e = make(reconcile_interval_seconds=3600)  # the reconciles are the test's
    e.start()
    be = rt.run_pod("be", "BestEffort")
    e.pod_added(be)
    shared = create(e, rt, be, "app", "BestEffort")
    start(e, rt, shared)
    late = create(e, rt, be, "late", "BestEffort")  # created; started after the lists
    old = rt.run_pod("old", "BestEffort")
    e.pod_added(old)
    old_c = create(e, rt, old, "app", "BestEffort")
    g = rt.run_pod("g", "Guaranteed")
    made: list[str] = []

    def meanwhile() -> None:
        rt.after_list = None
        e.pod_added(g)
        made.append(create(e, rt, g, "app", "Guaranteed", 1000))
        start(e, rt, made[0])
        start(e, rt, late)
        del rt.containers[old_c], rt.pods[old.id]
        e.pod_removed(old.id)

    rt.after_list = meanwhile
    s = e.reconcile()
    gid = made[0]
    cpu = e.container(gid).cpu_set
    assert len(cpu) == 1 and e.state().exclusive == {gid: format_cpulist(cpu)}
    assert (s.containers_removed, s.pods_removed, s.containers_added, s.pods_added) == (0, 0, 0, 0), s
    assert g.id in e.cache.pods and old.id not in e.cache.pods and old_c not in e.cache.containers
    assert e.container(late).state == State.RUNNING
    # read from the cgroup files: the shared containers left the exclusive CPU, and it has only that one
    assert rt.kernel_cpus(gid) == cpu and not (rt.kernel_cpus(shared) | rt.kernel_cpus(late)) & cpu
    assert e.check_invariants().ok
    # the next reconcile's lists have it all: nothing changes, and what the runtime lost is still found gone
    del rt.containers[shared]
    s = e.reconcile()
    assert (s.containers_removed, s.containers_added, s.exited) == (1, 0, 0), s
    assert e.state().exclusive == {gid: format_cpulist(cpu)} and e.container(late).state == State.RUNNING


def test_a_reconcile_leaves_a_create_in_flight_to_its_commit(node):
    """The runtime lists a container it has just created before the front end commits it: adopted then, it
    would join the shared pool (its reservation holds its CPU) and the pool worker would move it off its CPU."""
    rt, make = node
    e = make()
    be = rt.run_pod("be", "BestEffort")
    e.pod_added(be)
    shared = create(e, rt, be, "app", "BestEffort")
    start(e, rt, shared)
    g = rt.run_pod("g", "Guaranteed")
    e.pod_added(g)
    res = resources("Guaranteed", 1000)
    r = e.place(ContainerRequest(g.id, "app", g.namespace, g.name, g.uid, g.cgroup_parent, {}, {}, res))
    gid = rt.create(g, "app", r.cpus, res)  # the runtime has it; its answer is on the way to the front end
    s = e.reconcile()
    assert s.containers_added == 0 and gid not in e.cache.containers, s
    assert [u for u in rt.updates if u[0] == gid] == []
    e.commit(r, gid)
    e.apply_pool()
    c = e.container(gid)
    assert c.placement == Kind.EXCLUSIVE and c.cpu_set == parse_cpulist(r.cpus) == rt.kernel_cpus(gid)
    assert not rt.kernel_cpus(shared) & c.cpu_set and [u for u in rt.updates if u[0] == gid] == []
    assert e.check_invariants().ok


def test_a_failed_rewrite_rolls_the_books_back_to_what_the_runtime_got(node):
    rt, make = node
    e = make()
    e.start()
    p = rt.run_pod("g", "Guaranteed")
    e.pod_added(p)
    res = resources("Guaranteed", 1000)
    r = e.place(ContainerRequest(p.id, "app", p.namespace, p.name, p.uid, p.cgroup_parent, {}, {}, res))
    assert r.kind == Kind.EXCLUSIVE
    cid = rt.create(p, "app", "", res)  # the rewrite failed: the runtime got the original (no cpuset)
    e.commit_unplaced(r, cid, "")
    c = e.container(cid)
    assert c.placement == Kind.SHARED and "rewrite failed" in c.reason
    assert e.counters()[M.RELAY_REWRITE_ROLLBACKS.name] == 1
    assert e.state().exclusive == {} and e.state().pending == 0
    # the pool worker brings it into the pool: the kernel agrees with the books
    wait_for(lambda: rt.kernel_cpus(cid) == parse_cpulist(e.state().shared_pool), what="pool applied")


def test_a_shared_create_in_flight_gets_the_pool_an_exclusive_create_shrank(node):
    """The fault seen with no fault injected: BestEffort create placed on the whole pool, a Guaranteed create
    3 ms later takes a CPU of it; the BestEffort container must not keep that CPU."""
    rt, make = node
    e = make()
    e.start()
    be, g = rt.run_pod("be", "BestEffort"), rt.run_pod("g", "Guaranteed")
    e.pod_added(be)
    e.pod_added(g)
    r_be = e.place(ContainerRequest(be.id, "app", be.namespace, be.name, be.uid, be.cgroup_parent, {}, {},
                                    resources("BestEffort")))
    assert parse_cpulist(r_be.cpus) == rt.online
    gid = create(e, rt, g, "app", "Guaranteed", 1000)  # placed and committed while BestEffort is in flight
    excl = e.container(gid).cpu_set
    be_id = rt.create(be, "app", r_be.cpus, resources("BestEffort"))  # created with the old pool
    e.commit(r_be, be_id)
    start(e, rt, be_id)
    start(e, rt, gid)
    # By the time both may start, the BestEffort container's cgroup no longer has the exclusive CPU.
    assert not rt.kernel_cpus(be_id) & excl
    assert rt.kernel_cpus(gid) == excl
    report = e.check_invariants()
    assert report.ok and report.checked == 2, report


def test_pool_targets_name_what_the_pool_worker_would_change_without_calling_the_runtime(node):
    rt, make = node
    e = make()
    b, g = rt.run_pod("b", "Burstable"), rt.run_pod("g", "Guaranteed")
    e.pod_added(b)
    e.pod_added(g)
    bid = create(e, rt, b, "app", "Burstable", 500)
    assert e.pool_targets() == []
    gid = create(e, rt, g, "app", "Guaranteed", 1000)
    before = list(rt.updates)
    want = format_cpulist(rt.online - e.container(gid).cpu_set)
    assert [(t[0], t[1]) for t in e.pool_targets()] == [(bid, want)]
    assert rt.updates == before  # books only


def test_a_start_in_flight_counts_as_running_for_the_next_exclusive_start(node):
    """The shared container's start has been let through but its answer is not back (the books still say
    created): an exclusive container placed meanwhile must wait until the shared one is off its CPUs."""
    rt, make = node
    e = make()
    e.start()
    be, g = rt.run_pod("be", "BestEffort"), rt.run_pod("g", "Guaranteed")
    e.pod_added(be)
    e.pod_added(g)
    be_id = create(e, rt, be, "app", "BestEffort")
    assert e.wait_startable(be_id, 5)  # let through; started() not called yet
    rt.set_state(be_id, State.RUNNING)  # the runtime runs it
    rt.hang.set()  # and does not answer updates for a while
    gid = create(e, rt, g, "app", "Guaranteed", 1000)
    assert not e.wait_startable(gid, 0.5)  # held: the shared container still runs on its CPU
    rt.release.set()
    # the shared start's answer comes back: from here on its cgroup is read, and the pool update moved it off
    # (without this the engine learns of the start only at the next reconcile, which raced the 5 s wait)
    e.started(be_id)
    t = time.monotonic()
    assert e.wait_startable(gid, 5)
    assert time.monotonic() - t < 2.5
    assert not rt.kernel_cpus(be_id) & e.container(gid).cpu_set
    assert e.check_invariants().ok


def test_start_now_lets_a_shared_start_through_at_once_and_sends_anything_that_may_wait_to_the_worker(node):
    """The relay's event loop asks start_now; a start it refuses goes to wait_startable (off the event loop)."""
    rt, make = node
    e = make()
    e.start()
    be, g = rt.run_pod("be", "BestEffort"), rt.run_pod("g", "Guaranteed")
    e.pod_added(be)
    e.pod_added(g)
    be_id = create(e, rt, be, "app", "BestEffort")
    be2_id = create(e, rt, be, "app2", "BestEffort")
    assert e.start_now("not-in-the-books")
    assert e.start_now(be_id)  # nothing exclusive yet: through, and held as a start in flight
    rt.set_state(be_id, State.RUNNING)
    rt.hang.set()  # the runtime does not answer the pool updates that move them off the exclusive CPU
    gid = create(e, rt, g, "app", "Guaranteed", 1000)
    assert not e.start_now(gid)  # exclusive: checked against the kernel, so always by the worker
    # the second shared container was created on the old pool: its cpuset still holds the exclusive CPU
    assert not e.start_now(be2_id)
    rt.release.set()
    # be's start was let through: until its answer comes back (started) its CPUs are the ones it started with,
    # which held the exclusive CPU; without this the engine learns of it only at the next reconcile (the test
    # then raced the reconcile period against its own 5 s wait).
    e.started(be_id)
    t = time.monotonic()
    assert e.wait_startable(gid, 5) and e.wait_startable(be2_id, 5)
    assert time.monotonic() - t < 2.5  # woken by the pool updates, not by a reconcile or a timeout
    assert not rt.kernel_cpus(be_id) & e.container(gid).cpu_set
    assert e.check_invariants().ok


def test_invariants_read_from_the_kernel_are_repaired_by_repinning(node):
    rt, make = node
    e = make()
    g, b = rt.run_pod("g", "Guaranteed"), rt.run_pod("b", "Burstable")
    e.pod_added(g)
    e.pod_added(b)
    gid = create(e, rt, g, "app", "Guaranteed", 1000)
    bid = create(e, rt, b, "app", "Burstable", 500)
    e.apply_pool()
    start(e, rt, gid)
    start(e, rt, bid)
    excl = e.container(gid).cpu_set
    # someone else (an operator, a buggy tool) rewrites both cgroups behind the engine's back
    rt.cpuset_file(gid).write_text(format_cpulist(rt.online) + "\n")
    rt.cpuset_file(bid).write_text(format_cpulist(rt.online) + "\n")
    report = e.check_and_repair()
    assert {v.rule for v in report.violations} >= {"exclusive-mismatch", "shared-on-exclusive"}
    assert report.repaired == 2
    assert rt.kernel_cpus(gid) == excl and rt.kernel_cpus(bid) == rt.online - excl
    counters = e.counters()
    assert counters[M.RELAY_INVARIANT_VIOLATIONS.name] == len(report.violations)
    assert counters[M.RELAY_INVARIANT_REPAIRS.name] == 2
    assert e.check_invariants().ok


def test_crashed_and_oom_killed_containers_release_their_cpus(node):
    rt, make = node
    e = make(min_shared_cpus=2)
    e.start()
    pods = [rt.run_pod(n, "Guaranteed") for n in ("crash", "oom", "next")]
    for p in pods:
        e.pod_added(p)
    ids = [create(e, rt, p, "app", "Guaranteed", 1000) for p in pods[:2]]
    for cid in ids:
        start(e, rt, cid)
    with pytest.raises(InsufficientCpus):
        create(e, rt, pods[2], "app", "Guaranteed", 1000)
    rt.set_state(ids[0], State.EXITED)  # exit 1: reconcile sees it
    e.reconcile()
    e.exited_seen([ids[1]], "seen exited in ListContainers")  # OOM-killed: kubelet's relist shows it
    assert e.state().exclusive == {}
    nxt = create(e, rt, pods[2], "app", "Guaranteed", 1000)  # the re-created container is never refused
    assert list(e.state().exclusive) == [nxt]


def test_a_shared_placement_and_release_log_at_debug_and_exclusive_ones_at_info(node, caplog):
    """Every create places and every stop releases; only exclusive CPUs taken or given back are worth an info
    line (both run on the relay's event loop, right after the create's forward and the stop's answer)."""
    rt, make = node
    e = make(min_shared_cpus=2)
    e.start()
    g, b = rt.run_pod("g", "Guaranteed"), rt.run_pod("b", "Burstable")
    for p in (g, b):
        e.pod_added(p)
    caplog.set_level("DEBUG", logger="cri_resmgr.placement.engine")
    gid, bid = create(e, rt, g, "app", "Guaranteed", 1000), create(e, rt, b, "app", "Burstable", 500)
    for cid in (gid, bid):
        start(e, rt, cid)
    e.stopped(bid)
    e.stopped(gid)
    released = {r.levelname: r.getMessage() for r in caplog.records if "releasing" in r.getMessage()}
    assert set(released) == {"DEBUG", "INFO"}
    assert bid[:12] in released["DEBUG"] and "shared" in released["DEBUG"]
    assert gid[:12] in released["INFO"] and "exclusive" in released["INFO"]
    assert e.state().exclusive == {}
    placed = {r.levelname: r.getMessage() for r in caplog.records if r.getMessage().startswith("place ")}
    assert set(placed) == {"DEBUG", "INFO"}  # the shared placement at debug, the exclusive one at info
    assert "b/app" in placed["DEBUG"] and "g/app" in placed["INFO"]


def test_a_hung_pool_update_blocks_no_create_and_the_start_fails_open_bounded(node):
    rt, make = node
    e = make(start_hold_seconds=0.5, runtime_timeout_seconds=2.0)
    e.start()
    b, g, g2 = rt.run_pod("b", "Burstable"), rt.run_pod("g", "Guaranteed"), rt.run_pod("g2", "Guaranteed")
    for p in (b, g, g2):
        e.pod_added(p)
    bid = create(e, rt, b, "app", "Burstable", 500)
    start(e, rt, bid)
    rt.hang.set()  # the runtime stops answering UpdateContainerResources
    t0 = time.monotonic()
    gid = create(e, rt, g, "app", "Guaranteed", 1000)  # its pool update hangs in the pool worker
    create(e, rt, g2, "app", "Guaranteed", 1000)
    assert time.monotonic() - t0 < 0.3, "creates waited for the pool update"
    t0 = time.monotonic()
    assert not e.wait_startable(gid)  # bounded, then fail open (counted)
    assert 0.4 < time.monotonic() - t0 < 2
    assert e.counters()[M.RELAY_START_HOLD_TIMEOUTS.name] == 1
    rt.release.set()
    assert e.wait_startable(gid, 10)


def test_move_past_the_callers_deadline_changes_nothing(node):
    rt, make = node
    e = make()
    b = rt.run_pod("b", "Burstable")
    e.pod_added(b)
    bid = create(e, rt, b, "app", "Burstable", 500)
    e.apply_pool()
    before = list(rt.updates)
    rec = e.move(bid, "1", who="test", deadline=time.monotonic() - 0.1)
    assert rec.result == "refused" and "deadline" in rec.error and rt.updates == before
    rec = e.move(bid, "1", who="test", deadline=time.monotonic() + 5)
    assert rec.result == "applied" and rt.kernel_cpus(bid) == {1}


@pytest.mark.parametrize("content", ['{"version":1,"pods":[1]}', '{"version": 1, "containers": [{"id": 5}]}',
                                     '{"version": 1, "pods": [], "contai', "\x00\xff garbage"])
def test_an_unusable_cache_is_moved_aside_and_rebuilt_from_the_runtime(node, tmp_path, content):
    rt, make = node
    cache = tmp_path / "state" / "relay-cache.json"
    cache.write_bytes(content.encode("latin-1"))
    p = rt.run_pod("g", "Guaranteed")
    cid = rt.create(p, "app", "2", resources("Guaranteed", 1000), state=State.RUNNING)
    e = make()  # comes up whatever the file holds
    aside = list(cache.parent.glob("relay-cache.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content.encode("latin-1") and not cache.exists()
    assert e.counters()[M.RELAY_CACHE_CORRUPT.name] == 1
    e.reconcile()
    assert e.state().exclusive == {cid: "2"}
    assert e.persist() and json.loads(cache.read_text())["containers"][0]["id"] == cid


def test_enospc_keeps_the_previous_cache_whole_and_is_counted(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tiny tmpfs")
    state = tmp_path / "tiny"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(state)], check=True)
    try:
        topo = discover(build_sysfs(FOUR, tmp_path / "sys"))
        rt = EmulatedRuntime(tmp_path / "cgroup", frozenset(topo.cpus))
        e = Engine(EngineSettings(), topo, state, rt, cgroup_root=tmp_path / "cgroup")
        p = rt.run_pod("g", "Guaranteed")
        e.pod_added(p)
        assert e.persist()
        good = (state / "relay-cache.json").read_text()
        for i in range(60):  # the cache grows beyond what is left of the 64 KiB
            e.pod_added(PodRecord(id=f"pod{i}", name=f"p{i}" * 40, namespace="ns", uid="u",
                                  annotations={"k": "v" * 1000}))
        assert not e.persist()
        assert (state / "relay-cache.json").read_text() == good  # the previous file, whole
        assert [f.name for f in state.iterdir()] == ["relay-cache.json"]  # no temporary file left behind
        assert e.counters()[M.RELAY_CACHE_SAVE_FAILURES.name] == 1
    finally:
        subprocess.run(["umount", str(state)], check=True)


def test_background_threads_are_supervised_restarted_and_counted(node):
    rt, make = node
    e = make(reconcile_interval_seconds=0.05)
    rt.snapshot_error = KeyError("bug in a runtime port")  # not a RuntimeCallError: the thread dies
    e.start()
    wait_for(lambda: next(t for t in e.threads() if t.name == "reconcile").restarts >= 2, what="restarts")
    rt.snapshot_error = None
    view = next(t for t in e.state().threads if t.name == "reconcile")
    assert view.alive and "KeyError" in view.last_error
    assert e.counters()[M.RELAY_THREAD_RESTARTS.name] >= 2
    assert {t.name for t in e.threads()} == {"pool", "reconcile", "persist", "controllers"}


class Recorder:
    name = "recorder"

    def __init__(self, fail_on: str = ""):
        self.calls: list[tuple[str, str]] = []
        self.fail_on = fail_on

    def _rec(self, what: str, ctx: ContainerContext) -> None:
        self.calls.append((what, ctx.id))
        if what == self.fail_on:
            raise RuntimeError("controller bug")

    def started(self, ctx: ContainerContext) -> None:
        assert ctx.pod_namespace == "default" and ctx.cgroup_path.endswith(ctx.id)
        self._rec("started", ctx)

    def adopted(self, ctx: ContainerContext) -> None:
        self._rec("adopted", ctx)

    def stopped(self, ctx: ContainerContext) -> None:
        self._rec("stopped", ctx)

    def reload(self, running) -> None:
        self.calls.append(("reload", ",".join(c.id for c in running)))


def test_controllers_see_start_adopt_stop_once_and_reload_and_never_break_placement(node):
    rt, make = node
    e = make()
    rec, bad = Recorder(), Recorder(fail_on="started")
    e.add_controller(bad)
    e.add_controller(rec)
    e.start()
    p, q = rt.run_pod("a", "Burstable"), rt.run_pod("b", "Burstable")
    adopted = rt.create(q, "old", "", resources("Burstable", 100), state=State.RUNNING)
    e.reconcile()
    e.pod_added(p)
    cid = create(e, rt, p, "app", "Burstable", 100)
    start(e, rt, cid)
    e.reload_controllers()
    e.stopped(cid)
    e.removed(cid)  # released once, not twice
    assert e.flush_controllers(5)
    # at start every running container is enforced once (none yet here); then events in order
    assert rec.calls == [("reload", ""), ("adopted", adopted), ("started", cid), ("reload", f"{adopted},{cid}"),
                         ("stopped", cid)]
    assert e.counters()[M.RELAY_CONTROLLER_ERRORS.name] == 1
    assert e.state().exclusive == {} and e.container(cid) is None


def test_shared_lifecycles_wake_no_engine_thread_and_exclusive_creates_wake_the_pool_and_a_save(node):
    """Every wake-up costs the front end's hooks a thread switch: a BestEffort container's whole life (nothing
    in the pool changes, no control configured) wakes neither the pool worker, the persist thread nor the
    controllers; its books are saved at the persist thread's next tick. An exclusive create wakes the pool worker
    and a save at once."""
    from cri_resmgr.config import Config
    from cri_resmgr.placement.controllers.manager import ControlManager

    rt, make = node
    e = make()
    e.add_controller(ControlManager.from_config(Config()))  # the front ends' default: nothing to enforce
    e.start()
    base = e.wakeups()
    p = rt.run_pod("b", "BestEffort")
    e.pod_added(p)
    cid = create(e, rt, p, "app", "BestEffort")
    start(e, rt, cid)
    e.stopped(cid)
    e.removed(cid)
    e.pod_stopped(p.id)
    after = e.wakeups()
    assert {k: after[k] - base[k] for k in ("pool", "persist", "controllers")} == {
        "pool": 0, "persist": 0, "controllers": 0}
    wait_for(lambda: e.cache_path.exists() and [q["id"] for q in json.loads(e.cache_path.read_text())["pods"]]
             == [p.id], timeout=5, what="lazy save")
    assert e.wakeups()["persist_tick"] > base["persist_tick"]
    g = rt.run_pod("g", "Guaranteed")
    e.pod_added(g)
    create(e, rt, g, "app", "Guaranteed", 1000)
    w = e.wakeups()
    assert (w["pool"], w["persist"]) == (after["pool"] + 1, after["persist"] + 1)


def test_controls_with_nothing_configured_want_only_containers_that_name_a_class(tmp_path):
    """The engine skips the controllers thread for containers no controller wants; one naming a class by
    annotation still reaches it, so that an unknown class is reported as before."""
    from cri_resmgr.config import Config
    from cri_resmgr.placement.controllers.manager import ControlManager

    m = ControlManager.from_config(Config())
    plain = ContainerContext(id="c1", name="app", pod_id="p", pod_name="p", pod_namespace="default", pod_uid="u",
                             annotations={"other": "x"}, effective={}, qos_class="BestEffort", cgroup_parent="/x",
                             cgroup_path="/x/c1", cpus="", mems="", kind=Kind.SHARED)
    assert not m.wants(plain)
    named = dataclasses.replace(plain, id="c2", annotations={
        "blockioclass.cri-resource-manager.intel.com/pod": "nonesuch"})
    assert m.wants(named)
    m.apply(named)
    assert m.container_errors("c2")  # reported as an unknown class
    assert m.wants(dataclasses.replace(named, annotations={}))  # recorded: its stop must reach the controller


def test_a_start_in_flight_holds_the_next_exclusive_start_until_its_cgroup_can_be_read(node):
    """The runtime builds a starting container's cgroup from its spec as it was when the start began, and applies
    updates made meanwhile to the spec only (containerd 1.6): until the start has returned, the container may come
    up with any cpuset it had since, so an exclusive start taking one of those CPUs waits (seen on containerd with
    a start hung in ``runc create``: tests/integration/relay/test_relay_hung_call.py)."""
    rt, make = node
    e = make()
    e.start()
    be, g = rt.run_pod("be", "BestEffort"), rt.run_pod("g", "Guaranteed")
    e.pod_added(be)
    e.pod_added(g)
    be_id = create(e, rt, be, "app", "BestEffort")
    spec_at_start = rt.kernel_cpus(be_id)  # what its cgroup will get, whatever the books say later
    assert e.wait_startable(be_id, 5)  # let through; the runtime has not answered yet
    gid = create(e, rt, g, "app", "Guaranteed", 1000)
    g_cpus = e.container(gid).cpu_set
    wait_for(lambda: not e.container(be_id).cpu_set & g_cpus, what="the books move the starting container")
    assert not e.wait_startable(gid, 0.5)  # held: the starting container may still come up on that CPU
    rt.cpuset_file(be_id).write_text(format_cpulist(spec_at_start) + "\n")  # it does
    rt.set_state(be_id, State.RUNNING)
    e.started(be_id)
    assert e.wait_startable(gid, 5)  # once it has been re-pinned
    assert not rt.kernel_cpus(be_id) & g_cpus
    assert e.counters()[M.RELAY_START_HOLD_TIMEOUTS.name] == 1  # the 0.5 s wait above


def test_one_hung_pool_update_holds_no_other_containers_update(node):
    """The runtime hangs the update of one shared container: the others leave the new exclusive CPU at once, so
    the exclusive start waits only for the hung one (bounded)."""
    rt, make = node
    e = make(start_hold_seconds=1.0, runtime_timeout_seconds=3.0)
    e.start()
    pods = [rt.run_pod(n, "BestEffort") for n in ("x", "b1", "b2")]
    g = rt.run_pod("g", "Guaranteed")
    for p in (*pods, g):
        e.pod_added(p)
    ids = [create(e, rt, p, "app", "BestEffort") for p in pods]
    for cid in ids:
        start(e, rt, cid)
    hung, release = ids[0], threading.Event()
    update = rt.update_cpuset

    def hang_one(container_id: str, cpus: str, mems: str, resources: str, timeout: float) -> str:
        if container_id == hung and not release.wait(timeout):
            raise RuntimeCallError("UpdateContainerResources: DEADLINE_EXCEEDED")
        return update(container_id, cpus, mems, resources, timeout)

    rt.update_cpuset = hang_one  # type: ignore[method-assign]
    try:
        gid = create(e, rt, g, "app", "Guaranteed", 1000)
        g_cpus = e.container(gid).cpu_set
        wait_for(lambda: all(not rt.kernel_cpus(cid) & g_cpus for cid in ids[1:]), timeout=1,
                 what="the other shared containers off the exclusive CPU while one update hangs")
        assert rt.kernel_cpus(hung) & g_cpus
        assert not e.wait_startable(gid)  # only the hung one is in the way: bounded, then fail open
    finally:
        release.set()
    wait_for(lambda: not rt.kernel_cpus(hung) & g_cpus, what="the hung container re-pinned once released")
